"""StrictQwenImagePipeline: our guidance and Euler step around MMDiT, against diffusers' loop, traced, batch-invariant."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmdit_strict.kernels.trace import capture_trace
from mmdit_strict.tolerances import tolerance

# Same call as test_diffusers_dropin: two prompts, one shared negative, a non-square 2x3 token grid, 2 steps
# (diffusers 0.42.1's default schedule has a NaN sigma for one step).
CALL = dict(prompt=["a red cat on a mat", "blue"], negative_prompt=" ", true_cfg_scale=4.0, height=32, width=48,
            num_inference_steps=2)


@pytest.fixture()
def pipes(tiny_pipe):
    """(diffusers' QwenImagePipeline with our strict MMDiT, our StrictQwenImagePipeline over the same components)."""
    from mmdit_strict.pipelines.diffusers_adapter import use_mmdit
    from mmdit_strict.pipelines.strict_pipeline import strict_pipeline

    use_mmdit(tiny_pipe, runtime="strict")
    return tiny_pipe, strict_pipeline(tiny_pipe, runtime="strict")


def _call(pipe, output_type: str, **kw):
    return pipe(generator=torch.Generator().manual_seed(0), output_type=output_type, **{**CALL, **kw}).images


def _check(name: str, got, expected, what: str) -> None:
    got_t, exp_t = torch.as_tensor(np.asarray(got)).float(), torch.as_tensor(np.asarray(expected)).float()
    assert got_t.shape == exp_t.shape, f"{what}: shape {tuple(got_t.shape)} vs {tuple(exp_t.shape)}"
    ok, max_abs, _ = tolerance("pipelines", name, "fp32").check(got_t, exp_t)
    assert ok, f"{what}: max abs {max_abs:.3e}"


def test_matches_diffusers_loop(pipes):
    theirs, ours = pipes
    _check("strict_loop_latents_vs_diffusers", _call(ours, "latent"), _call(theirs, "latent"), "latents, CFG 4")
    _check("strict_loop_images_vs_diffusers", _call(ours, "np"), _call(theirs, "np"), "images, CFG 4")
    # one prompt without guidance: same encoding, same transformer calls, and our FP32 Euler step is byte-equal
    # to the scheduler's (a list of prompts is encoded one at a time by ours, batched by diffusers)
    plain = dict(prompt="a red cat on a mat", negative_prompt=None, true_cfg_scale=1.0, num_inference_steps=3)
    assert torch.equal(_call(ours, "latent", **plain), _call(theirs, "latent", **plain))


def test_trace_shows_guidance_and_transformer(pipes):
    _, ours = pipes
    with capture_trace() as trace:
        _call(ours, "latent")
    records = list(trace.records.values())
    assert trace.fallbacks == []
    by_op = {r.op: r for r in records}
    assert by_op["cfg_combine_renorm"].actual_backend == "torch_fixed"
    assert by_op["cfg_combine_renorm"].calls == CALL["num_inference_steps"]
    assert by_op["flow_euler_step"].actual_backend == "torch_fixed"  # the step is a registered, traced operator
    assert by_op["flow_euler_step"].calls == CALL["num_inference_steps"]
    assert by_op["flow_sigma_table"].actual_backend == "torch_fixed"
    model_ops = [r for r in records if r.actual_backend == "cpu_strict"]
    assert model_ops, f"no cpu_strict transformer operators in the trace: {sorted(by_op)}"
    assert all(r.requested == "strict" for r in records)


def test_prompt_alone_equals_prompt_in_batch(pipes):
    """End-to-end batch invariance: one prompt alone and the same prompt first in a batch of 3 (longer
    prompts after it, so the batch is padded), with the same initial noise, give the same latent bytes."""
    _, ours = pipes
    prompts = ["a red cat on a mat", "blue", "a very long prompt about a green house by a lake at dawn"]
    noise = torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(3))
    batch = _call(ours, "latent", prompt=prompts, latents=noise)
    for i in range(3):
        alone = _call(ours, "latent", prompt=prompts[i], latents=noise[i:i + 1])
        assert torch.equal(alone[0], batch[i]), f"prompt {i}: alone differs from in the batch of 3"


@pytest.mark.parametrize("kw, match", [
    (dict(num_images_per_prompt=2), "does not support \\['num_images_per_prompt'\\]"),
    (dict(guidance_scale=1.0), "does not support \\['guidance_scale'\\]"),
    (dict(callback_on_step_end=lambda *a: {}), "does not support \\['callback_on_step_end'\\]"),
    (dict(attention_kwargs={"scale": 0.5}), "does not support \\['attention_kwargs'\\]"),
    (dict(output_type="latents"), "output_type must be one of"),
    (dict(num_inference_steps=1), "num_inference_steps must be >= 2"),
])
def test_refuses_unsupported_arguments(pipes, kw, match):
    _, ours = pipes
    with pytest.raises(ValueError, match=match):
        ours(**{**CALL, **kw})


def test_refuses_typos_and_diffusers_transformer(pipes, tiny_pipeline_dir):
    from diffusers import QwenImageTransformer2DModel

    _, ours = pipes
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['num_inference_step'\\]"):
        ours(prompt="x", num_inference_step=2)
    ours.transformer = QwenImageTransformer2DModel.from_pretrained(str(tiny_pipeline_dir / "transformer"))
    with pytest.raises(TypeError, match="needs an MMDiT transformer"):
        ours(**CALL)


def test_with_the_strict_sde_scheduler_the_trace_shows_guidance_and_the_sde_step(pipes):
    """The strict loop steps through a StrictFlowMatchScheduler(sde=True): CFG combine and the SDE
    step + logp are traced operators, and each step's log-probability is kept."""
    from mmdit_strict.pipelines.scheduler import StrictFlowMatchScheduler

    _, ours = pipes
    ours.scheduler = StrictFlowMatchScheduler.from_config(ours.scheduler.config, sde=True, eta=0.7, noise_seed=5)
    with capture_trace() as trace:
        first = _call(ours, "latent")
    by_op = {r.op: r for r in trace.records.values()}
    steps = CALL["num_inference_steps"]
    assert by_op["cfg_combine_renorm"].calls == steps
    assert by_op["flow_sde_step_logp"].calls == steps
    assert "flow_euler_step" not in by_op
    assert len(ours.last_log_probs) == steps and all(lp.shape == (2,) and torch.isfinite(lp).all()
                                                      for lp in ours.last_log_probs)
    assert torch.equal(_call(ours, "latent"), first)  # noise keyed by (seed, sample, step)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_bf16_loop_runs_on_triton_and_keeps_a_prompts_bytes_in_a_batch(tiny_pipeline_dir):
    """The strict pipeline with every component in BF16 on the GPU: the transformer's operators are the strict
    Triton kernels (no fallback), guidance and the step are traced, and a prompt's latents alone equal its latents
    first in a padded batch of 3, byte for byte."""
    from mmdit_strict.pipelines.diffusers_adapter import load_pipeline, route_lora_methods
    from mmdit_strict.pipelines.strict_pipeline import StrictQwenImagePipeline

    pipe = load_pipeline(tiny_pipeline_dir, runtime="strict", torch_dtype=torch.bfloat16, device="cuda")
    components = dict(pipe.components)
    model = components.pop("transformer")
    ours = StrictQwenImagePipeline(transformer=None, **components)
    ours.transformer = model
    route_lora_methods(ours, model)
    prompts = ["a red cat on a mat", "blue", "a very long prompt about a green house by a lake at dawn"]
    noise = torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(3)).to("cuda", torch.bfloat16)
    with capture_trace() as trace:
        batch = _call(ours, "latent", prompt=prompts, latents=noise)
    assert trace.fallbacks == []
    backends = {r.op: r.actual_backend for r in trace.records.values()}
    assert backends["cfg_combine_renorm"] == "torch_fixed" and backends["flow_euler_step"] == "torch_fixed"
    assert backends["joint_attention_fused"] == "triton", backends
    alone = _call(ours, "latent", prompt=prompts[0], latents=noise[:1])
    assert torch.equal(alone[0], batch[0])

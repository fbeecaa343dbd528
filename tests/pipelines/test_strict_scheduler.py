"""StrictFlowMatchScheduler inside diffusers' own QwenImagePipeline: our sigma table and steps, traced."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mmdit_strict.kernels.trace import capture_trace

CALL = dict(prompt=["a red cat on a mat", "blue"], negative_prompt=" ", true_cfg_scale=4.0, height=32, width=48,
            num_inference_steps=3)


@pytest.fixture()
def strict_pipe(tiny_pipe):
    from mmdit_strict.pipelines.diffusers_adapter import use_mmdit

    use_mmdit(tiny_pipe, runtime="strict")
    return tiny_pipe


def _latents(pipe, **kw):
    return pipe(generator=torch.Generator().manual_seed(0), output_type="latent", **{**CALL, **kw}).images


def test_euler_mode_gives_diffusers_scheduler_bytes_and_traces_every_step(strict_pipe) -> None:
    from mmdit_strict.pipelines.scheduler import StrictFlowMatchScheduler

    theirs = _latents(strict_pipe)
    strict_pipe.scheduler = StrictFlowMatchScheduler.from_config(strict_pipe.scheduler.config)
    with capture_trace() as trace:
        ours = _latents(strict_pipe)
    assert torch.equal(ours, theirs), "our sigma table and FP32 Euler step are byte-equal to diffusers' scheduler"
    by_op = {r.op: r for r in trace.records.values()}
    assert by_op["flow_sigma_table"].calls == 1
    assert by_op["flow_euler_step"].calls == CALL["num_inference_steps"]
    assert by_op["flow_euler_step"].actual_backend == "torch_fixed"


def test_sde_mode_steps_with_logp_and_keyed_noise(strict_pipe) -> None:
    from mmdit_strict.pipelines.scheduler import StrictFlowMatchScheduler
    from mmdit_strict.sampling import sde_step, step_noise

    sched = StrictFlowMatchScheduler.from_config(strict_pipe.scheduler.config, sde=True, eta=0.7, noise_seed=3)
    strict_pipe.scheduler = sched
    with capture_trace() as trace:
        a = _latents(strict_pipe)
    assert {r.op for r in trace.records.values()} >= {"flow_sigma_table", "flow_sde_step_logp"}
    assert torch.equal(_latents(strict_pipe), a), "noise keyed by (seed, sample, step): the same bytes again"
    # one step by hand equals the sampling module's SDE step with the keyed noise
    sched.set_timesteps(3, mu=0.6)
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(2, 6, 64, generator=g), torch.randn(2, 6, 64, generator=g)
    out = sched.step(v, sched.timesteps[0], x)
    want = sde_step(v, x, sched.sigmas[0], sched.sigmas[1], noise=step_noise(3, [0, 1], 0, (6, 64)), eta=0.7,
                    sigma_max=float(sched.sigmas[1]))
    assert torch.equal(out.prev_sample, want.x_prev) and torch.equal(out.log_prob, want.logp)
    # scoring a recorded sample (Flow-GRPO's recompute) gives the same log-probability
    sched.set_timesteps(3, mu=0.6)
    again = sched.step(v, sched.timesteps[0], x, prev_sample=want.x_prev)
    assert torch.equal(again.log_prob, want.logp) and torch.equal(again.prev_sample, want.x_prev)


def test_config_round_trip_and_scale_noise(tmp_path: Path, tiny_pipe) -> None:
    from mmdit_strict.pipelines.scheduler import StrictFlowMatchScheduler

    sched = StrictFlowMatchScheduler.from_config(tiny_pipe.scheduler.config, sde=True, eta=0.5)
    sched.save_pretrained(tmp_path)
    back = StrictFlowMatchScheduler.from_pretrained(tmp_path)
    assert back.config.sde is True and back.config.eta == 0.5 and back.config.max_shift == tiny_pipe.scheduler.config.max_shift
    theirs = tiny_pipe.scheduler
    spacing = np.linspace(1.0, 1.0 / 4, 4)  # what QwenImagePipeline hands its scheduler
    theirs.set_timesteps(sigmas=spacing, mu=0.7)
    back.set_timesteps(sigmas=spacing, mu=0.7)
    assert torch.equal(back.sigmas, theirs.sigmas) and torch.equal(back.timesteps, theirs.timesteps)
    g = torch.Generator().manual_seed(2)
    x, n = torch.randn(1, 6, 64, generator=g), torch.randn(1, 6, 64, generator=g)
    t = theirs.timesteps[1:2]
    theirs.set_begin_index(1)
    back.set_begin_index(1)
    assert torch.equal(back.scale_noise(x, t, n), theirs.scale_noise(x, t, n))


@pytest.mark.parametrize("kw, message", [({"use_dynamic_shifting": False}, "Qwen-Image's schedule"),
                                         ({"shift_terminal": 1.5}, "shift_terminal")])
def test_unsupported_schedules_are_refused(kw: dict, message: str) -> None:
    from mmdit_strict.pipelines.scheduler import StrictFlowMatchScheduler

    with pytest.raises(ValueError, match=message):
        StrictFlowMatchScheduler(**kw)
    sched = StrictFlowMatchScheduler()
    with pytest.raises(ValueError, match="custom timesteps"):
        sched.set_timesteps(timesteps=[900.0, 500.0], mu=0.5)
    with pytest.raises(ValueError, match="custom sigmas"):
        sched.set_timesteps(sigmas=[1.0, 0.3], mu=0.5)
    with pytest.raises(RuntimeError, match="set_timesteps"):
        StrictFlowMatchScheduler().step(torch.zeros(1, 2), 1.0, torch.zeros(1, 2))

"""MMDiT as QwenImagePipeline.transformer: the diffusers pipeline runs unchanged and matches its own transformer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmdit_strict import MMDiT
from mmdit_strict.pipelines.diffusers_adapter import load_pipeline, mmdit_from_diffusers, use_mmdit
from mmdit_strict.tolerances import tolerance

# Two prompts and one negative string: the negative is encoded once and broadcast over the batch by the
# transformer, as diffusers does. 32x48 pixels: a non-square 2x3 token grid.
CALL = dict(prompt=["a red cat on a mat", "blue"], negative_prompt=" ", true_cfg_scale=4.0, height=32, width=48,
            num_inference_steps=2)


def _call(pipe, output_type: str, **kw):
    return pipe(generator=torch.Generator().manual_seed(0), output_type=output_type, **{**CALL, **kw}).images


def _check(name: str, got, expected, what: str) -> None:
    got_t, exp_t = torch.as_tensor(np.asarray(got)), torch.as_tensor(np.asarray(expected))
    assert got_t.shape == exp_t.shape, f"{what}: shape {tuple(got_t.shape)} vs {tuple(exp_t.shape)}"
    ok, max_abs, _ = tolerance("pipelines", name, "fp32").check(got_t, exp_t)
    assert ok, f"{what}: max abs {max_abs:.3e}"


@pytest.mark.slow
def test_pipeline_images_match_diffusers_transformer(tiny_pipe, tiny_pipeline_dir):
    ref_latents = _call(tiny_pipe, "latent")
    ref_images = _call(tiny_pipe, "np")
    for runtime in ("off", "strict"):
        tiny_pipe.transformer = MMDiT.from_pretrained(tiny_pipeline_dir, runtime=runtime)  # plain assignment
        _check("dropin_latents_vs_diffusers", _call(tiny_pipe, "latent"), ref_latents, f"latents [{runtime}]")
        _check("dropin_images_vs_diffusers", _call(tiny_pipe, "np"), ref_images, f"images [{runtime}]")


def test_num_images_per_prompt_and_shared_weights(tiny_pipe):
    """num_images_per_prompt=2 passes img_shapes with one entry per prompt, not per image; use_mmdit
    shares the diffusers model's parameter tensors instead of copying them."""
    kw = dict(prompt="a cat", negative_prompt=None, true_cfg_scale=1.0, num_images_per_prompt=2, height=32, width=32)
    ref = _call(tiny_pipe, "latent", **kw)
    original = tiny_pipe.transformer
    model = use_mmdit(tiny_pipe, runtime="strict")
    assert tiny_pipe.transformer is model
    assert model.img_in.weight.data_ptr() == original.img_in.weight.data_ptr()
    _check("dropin_latents_vs_diffusers", _call(tiny_pipe, "latent", **kw), ref, "num_images_per_prompt=2 [strict]")


def test_load_pipeline_and_pipeline_lora(tiny_pipeline_dir, tmp_path):
    """load_pipeline puts MMDiT in place; pipe.load_lora_weights reaches it, and the pipeline's adapter
    methods (which diffusers applies to its own ModelMixin components only) are routed to it."""
    from diffusers import QwenImagePipeline
    from peft import LoraConfig

    ref_pipe = QwenImagePipeline.from_pretrained(str(tiny_pipeline_dir))
    ref_pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(5)
    ref_pipe.transformer.add_adapter(
        LoraConfig(r=2, lora_alpha=4, target_modules=["to_q", "to_out.0", "txt_mlp.net.0.proj"], init_lora_weights=False),
        adapter_name="x")
    ref_pipe.transformer.save_lora_adapter(str(tmp_path / "lora"), adapter_name="x")

    pipe = load_pipeline(tiny_pipeline_dir, runtime="off")
    pipe.set_progress_bar_config(disable=True)
    assert isinstance(pipe.transformer, MMDiT)
    pipe.load_lora_weights(str(tmp_path / "lora"), weight_name="pytorch_lora_weights.safetensors", adapter_name="x")
    assert pipe.get_list_adapters() == {"transformer": ["x"]}
    kw = dict(height=32, width=32)
    for what, act in (("loaded", None), ("weight 0.3", lambda p: p.set_adapters(["x"], [0.3])),
                      ("disabled", lambda p: p.disable_lora())):
        if act is not None:
            act(ref_pipe)
            act(pipe)
        _check("dropin_latents_vs_diffusers", _call(pipe, "latent", **kw), _call(ref_pipe, "latent", **kw), f"LoRA {what}")
    pipe.delete_adapters("x")
    assert pipe.transformer.adapter_names() == []
    with pytest.raises(ValueError, match="fuse_lora is not supported"):
        pipe.fuse_lora()


def test_mmdit_from_diffusers_refuses_lora_and_other_models(tiny_pipe):
    from peft import LoraConfig

    with pytest.raises(ValueError, match="expected diffusers' QwenImageTransformer2DModel"):
        mmdit_from_diffusers(torch.nn.Linear(2, 2))
    tiny_pipe.transformer.add_adapter(LoraConfig(r=2, target_modules=["to_q"]), adapter_name="y")
    with pytest.raises(ValueError, match="carries LoRA layers"):
        mmdit_from_diffusers(tiny_pipe.transformer)


def test_pipeline_save_pretrained_keeps_the_transformer(tiny_pipeline_dir, tmp_path):
    """pipe.save_pretrained with MMDiT inside writes a folder that loads back (ours: same bytes; diffusers: in tolerance)."""
    import json

    from diffusers import QwenImagePipeline

    pipe = load_pipeline(tiny_pipeline_dir, runtime="strict")
    pipe.set_progress_bar_config(disable=True)
    before = _call(pipe, "latent", height=32, width=32)
    pipe.save_pretrained(str(tmp_path / "saved"))
    assert json.loads((tmp_path / "saved" / "model_index.json").read_text())["transformer"] == [
        "diffusers", "QwenImageTransformer2DModel"]
    again = load_pipeline(tmp_path / "saved", runtime="strict")
    again.set_progress_bar_config(disable=True)
    assert torch.equal(_call(again, "latent", height=32, width=32), before), "reloaded MMDiT pipeline changed bytes"
    theirs = QwenImagePipeline.from_pretrained(str(tmp_path / "saved"))
    theirs.set_progress_bar_config(disable=True)
    _check("dropin_latents_vs_diffusers", _call(theirs, "latent", height=32, width=32), before, "saved folder in diffusers")

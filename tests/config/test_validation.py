"""Every config check happens at compose time, before any work, with a message naming the key."""

from __future__ import annotations

import pytest

from mmdit_strict.config.compose import ConfigError, compose


@pytest.mark.parametrize("overrides, message", [
    (["sampler.num_steps=0"], "sampler.num_steps must be between 1 and 1000"),
    (["sampler.num_steps=100000"], "sampler.num_steps must be between 1 and 1000"),
    (["sampler.height=-16"], "sampler.height must be a positive multiple of 16"),
    (["sampler.width=100"], "sampler.width must be a positive multiple of 16"),
    (["sampler.height=16384"], "sampler.height"),
    (["sampler.eta=0"], "sampler.eta must be > 0"),
    (["sampler.cfg_scale=nan"], "sampler.cfg_scale"),
    (["model.preset=qwen-image"], "model.allow_large_cpu=true"),
    (["model.num_layers=0"], "model.num_layers"),
    (["recompute.micro_batch=0"], "recompute.micro_batch must be >= 1"),
    (["rollout.batch_size=0"], "rollout.batch_size must be >= 1"),
    (["rollout.pad_to=0"], "rollout.pad_to"),
    (["recompute.pad_to=5"], "recompute.pad_to=5 is shorter than prompts.max_tokens=12"),
    (["lora.rank=-1"], "lora.rank must be >= 0"),
    (["lora.rank=2", "lora.targets=[]"], "lora.targets"),
    (["prompts.num_prompts=0"], "prompts.num_prompts must be between 1 and"),
    (["prompts.min_tokens=0"], "prompts.min_tokens"),
    (["prompts.min_tokens=9", "prompts.max_tokens=3"], "prompts.min_tokens"),
    (["prompts.embeddings=/nonexistent/e.safetensors"], "prompts.embeddings"),
    (["output_dir="], "output_dir must name a folder"),
    (["output_dir=  "], "output_dir must name a folder"),
    (["recompute.inject_fault=block1.img.mlp_down_gemm@6"], "step 6 but sampler.num_steps=6"),
    (["recompute.inject_fault=block9.img.mlp_down_gemm@1"], "block 9 but the model has 2 blocks"),
    (["recompute.inject_fault=@1"], "recompute.inject_fault must look like"),
    (["recompute.inject_fault=block1.img.mlp_down_gemm@x"], "recompute.inject_fault must look like"),
])
def test_bad_values_are_refused_at_compose(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        compose(overrides)


def test_good_values_compose() -> None:
    compose(["model.preset=qwen-image", "model.allow_large_cpu=true"])
    compose(["lora.rank=0", "recompute.pad_to=12", "rollout.pad_to=40", "sampler.num_steps=1000"])
    compose(["recompute.inject_fault=block1.img.mlp_down_gemm@5"])
    compose(["model.num_layers=3", "recompute.inject_fault=block2.txt.qkv_bias_gemm@0"])
    compose(["recompute.inject_fault=block1.img.mlp_down_gemm@1", "recompute.runtime=off"])  # off runs the same operators
    compose(["sampler.sde=false", "sampler.eta=0"])
    # the qwen-image group is for a GPU: its device is cuda, so the CPU guard does not apply
    assert compose(["model=qwen-image"]).model.device == "cuda"

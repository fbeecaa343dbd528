"""The whole tiny model through the Triton kernels on the CPU (interpreter, FP32; ``tests/model/triton_cpu.py``):
model-level claims of the GPU path that need no GPU to hold — the gated-residual epilogue's forward equals the unfused
one, and a checkpointed LoRA step runs the attention forward once per block and keeps the plain step's bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmdit_strict.config.arch import preset
from mmdit_strict.config.schema import LoraConfig
from mmdit_strict.kernels.triton import attention as A
from mmdit_strict.kernels.triton.gemm import autograd as gemm_autograd
from mmdit_strict.model.init import build_model
from mmdit_strict.trajectories.setup import attach_lora
from tests.harness import assert_bytes_equal
from tests.helpers import make_inputs
from tests.kernels.triton_rows import interp
from tests.model.triton_cpu import triton_on_the_cpu


def _model(num_layers: int, lora: bool):
    arch = dataclasses.replace(preset("tiny"), num_layers=num_layers)
    model = build_model(arch, seed=0, runtime="strict", dtype=torch.float32, device="cpu")
    if lora:
        attach_lora(model, LoraConfig(rank=4, alpha=8.0, init="random", seed=3))
    model.requires_grad_(False)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    inputs = make_inputs(2, (4, 4), [9, 4], txt_dim=arch.joint_attention_dim, seed=4, sigma=[0.3, 0.8])
    inputs.pop("guidance", None)
    return arch, model, inputs


@interp
def test_the_gated_residual_epilogue_gives_the_unfused_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    triton_on_the_cpu(monkeypatch)
    _, model, inputs = _model(1, lora=True)
    with torch.no_grad():
        plain = model(**inputs).sample
        fused_calls: list[int] = []
        real = gemm_autograd.gemm_gate_residual
        monkeypatch.setattr(gemm_autograd, "gemm_gate_residual", lambda *a, **k: fused_calls.append(1) or real(*a, **k))
        gemm_autograd.offer_gate_residual_fusion(True)
        try:
            fused = model(**inputs).sample
        finally:
            gemm_autograd.offer_gate_residual_fusion(gemm_autograd.GATE_RESIDUAL_FUSION)
    assert len(fused_calls) == 2 * 2  # attention-out and MLP-down of both streams
    assert_bytes_equal(fused, plain, "gated epilogue vs unfused, whole model")


@interp
def test_a_checkpointed_lora_step_runs_each_attention_forward_once(monkeypatch: pytest.MonkeyPatch) -> None:
    triton_on_the_cpu(monkeypatch)
    arch, model, inputs = _model(1, lora=True)
    params = [p for p in model.parameters() if p.requires_grad]
    runs: list[int] = []
    real = A.attention_fwd
    monkeypatch.setattr(A, "attention_fwd", lambda *a, **k: runs.append(1) or real(*a, **k))
    steps = {}
    for checkpointing in (True, False):
        model.enable_gradient_checkpointing(checkpointing)
        runs.clear()
        x = inputs["hidden_states"].clone().requires_grad_(True)
        out = model(**{**inputs, "hidden_states": x}).sample
        grads = torch.autograd.grad(out.square().sum(), [x] + params, allow_unused=True)
        steps[checkpointing] = [out.detach(), *(g for g in grads if g is not None)]
        assert len(runs) == arch.num_layers, f"checkpointing={checkpointing}: {len(runs)} attention forwards"
    assert len(steps[True]) == len(steps[False]) > 2
    for i, (a, c) in enumerate(zip(steps[True], steps[False])):
        assert_bytes_equal(a, c, f"output / gradient {i}: checkpointed vs not")

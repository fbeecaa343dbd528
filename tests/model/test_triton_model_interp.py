"""The whole tiny model through the Triton kernels on the CPU (interpreter, FP32; ``tests/model/triton_cpu.py``):
model-level claims of the GPU path that need no GPU to hold — the gated-residual epilogue's forward equals the unfused
one, and a checkpointed LoRA step runs the attention forward once per block and keeps the plain step's bytes."""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.kernels.triton.gemm import autograd as gemm_autograd
from tests.harness import assert_bytes_equal
from tests.helpers import make_inputs
from tests.kernels.triton_rows import interp
from tests.model.test_strict_launch_economy import check_one_attention_forward_per_block
from tests.model.triton_cpu import tiny_lora_model, triton_on_the_cpu


def _model(num_layers: int):
    arch, model, _ = tiny_lora_model(num_layers, checkpointing=False)
    inputs = make_inputs(2, (4, 4), [9, 4], txt_dim=arch.joint_attention_dim, seed=4, sigma=[0.3, 0.8])
    inputs.pop("guidance", None)
    return arch, model, inputs


@interp
def test_the_gated_residual_epilogue_gives_the_unfused_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    triton_on_the_cpu(monkeypatch)
    _, model, inputs = _model(1)
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
    arch, model, inputs = _model(1)
    check_one_attention_forward_per_block(model, inputs, arch.num_layers, monkeypatch)

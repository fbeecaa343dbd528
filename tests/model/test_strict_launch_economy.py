"""Work the strict forward does not repeat, with no byte changed: SiLU(temb) once per forward
(``kernels/prologues.py``: the modulation products of every block and the final AdaLN share one prologue pass, a
checkpoint recompute reuses it), and each block's modulation products made outside its gradient checkpoint (the
recompute skips them)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from mmdit_strict import MMDiT
from mmdit_strict.kernels.cpu import gemm as cpu_gemm
from mmdit_strict.kernels.prologues import PrologueMemo, prologue_pass, shared_prologues
from mmdit_strict.model import strict
from tests.harness import assert_bytes_equal
from tests.helpers import make_inputs


def _count_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    passes: list[int] = []
    real = cpu_gemm._prologue
    monkeypatch.setattr(cpu_gemm, "_prologue", lambda t, act: passes.append(1) or real(t, act))
    return passes


def _step(model: MMDiT, inputs: dict[str, Any]) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    x = inputs["hidden_states"].clone().requires_grad_(True)
    out = model(**{**inputs, "hidden_states": x}).sample
    grads = torch.autograd.grad(out.square().sum(), [x] + params, allow_unused=True)
    return [out.detach(), *(g for g in grads if g is not None)]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_one_silu_pass_per_forward_and_the_same_bytes(tiny_ckpt, monkeypatch: pytest.MonkeyPatch,
                                                      checkpointing: bool) -> None:
    model = MMDiT.from_pretrained(tiny_ckpt[0], runtime="strict")
    model.enable_gradient_checkpointing(checkpointing)
    blocks = len(model.transformer_blocks)
    inputs = make_inputs(3, (4, 4), [5, 3, 7])
    passes = _count_passes(monkeypatch)

    shared = _step(model, inputs)
    assert len(passes) == 1, f"{len(passes)} SiLU(temb) passes for one forward + backward"
    passes.clear()
    monkeypatch.setattr(strict, "shared_prologues", contextlib.nullcontext)  # each product its own pass, as before
    own = _step(model, inputs)
    assert len(passes) == 2 * blocks + 1  # checkpointed, the modulation products run outside the recompute
    assert len(shared) == len(own)
    for i, (a, c) in enumerate(zip(shared, own)):
        assert_bytes_equal(a, c, f"output / gradient {i}: shared SiLU(temb) vs one pass per product")


def test_checkpoint_recompute_skips_the_modulation_products(tiny_ckpt) -> None:
    """Checkpointed forward + backward: every modulation product runs once (the recomputes run in the forward's
    context, so they would be recorded too), the block's other products twice; full fine-tuning, so temb's
    gradient sums 2·blocks + 1 contributions, and every byte equals the run without checkpointing."""
    runs = {}
    for checkpointing in (False, True):
        model = MMDiT.from_pretrained(tiny_ckpt[0], runtime="strict")
        model.enable_gradient_checkpointing(checkpointing)
        with strict.record_gemms() as calls:
            runs[checkpointing] = _step(model, make_inputs(2, (4, 4), [5, 3]))
        blocks = len(model.transformer_blocks)
        mods = [c for c in calls if c.op == "adaln_mod_projection"]
        mlp_down = [c for c in calls if c.op == "mlp_down_gemm"]
        assert len(mods) == 2 * blocks
        assert len(mlp_down) == 2 * blocks * (2 if checkpointing else 1)
    assert len(runs[False]) == len(runs[True])
    for i, (a, c) in enumerate(zip(runs[False], runs[True])):
        assert_bytes_equal(a, c, f"output / gradient {i}: checkpointing off vs on")


def test_memo_reuses_only_the_same_unchanged_tensor() -> None:
    calls: list[str] = []

    def compute(t: torch.Tensor, act: str) -> torch.Tensor:
        calls.append(act)
        return t * 2

    x = torch.ones(2, 3)
    memo = PrologueMemo()
    first = memo.apply(x, "silu", compute)
    assert memo.apply(x, "silu", compute) is first and len(calls) == 1
    assert memo.apply(x.clone(), "silu", compute) is not first  # equal values, another tensor
    assert memo.apply(x, "gelu", compute) is not first  # another activation
    x.add_(1)  # in place: a new version
    assert torch.equal(memo.apply(x, "silu", compute), torch.full((2, 3), 4.0))
    assert (memo.evaluations, memo.reuses, len(calls)) == (4, 1, 4)
    with torch.inference_mode():
        y = torch.ones(2)
        memo.apply(y, "silu", compute)
        memo.apply(y, "silu", compute)
    assert len(calls) == 6  # inference tensors carry no version counter: never reused


def test_no_memo_outside_a_shared_block() -> None:
    calls: list[int] = []
    x = torch.ones(2)

    def compute(t: torch.Tensor, act: str) -> torch.Tensor:
        calls.append(1)
        return t

    prologue_pass(x, "silu", compute)
    prologue_pass(x, "silu", compute)
    assert len(calls) == 2
    with shared_prologues() as memo:
        prologue_pass(x, "silu", compute)
        prologue_pass(x, "silu", compute)
    assert len(calls) == 3 and memo.reuses == 1


@pytest.mark.gpu
def test_gpu_gated_residual_epilogue_keeps_the_forward_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the GEMM engine's gated-residual epilogue offered to the model (``GATE_RESIDUAL_FUSION``, off by default),
    a no-grad strict forward at Qwen-Image's widths, LoRA attached, takes it for every attention-output and MLP-down
    product and gives the unfused forward's bytes; uncaptured, so each forward runs its own launches."""
    from mmdit_strict.config.schema import LoraConfig
    from mmdit_strict.kernels.execution import Runtime
    from mmdit_strict.kernels.registry import resolve
    from mmdit_strict.kernels.triton import gemm as G
    from mmdit_strict.trajectories.setup import attach_lora
    from tests.helpers import strict_qwen_image_cuda

    arch, model = strict_qwen_image_cuda(num_layers=2)
    attach_lora(model, LoraConfig(rank=16, alpha=16.0, init="random", seed=2))
    model.enable_cuda_graphs(False)
    inputs = make_inputs(2, (32, 32), [77, 20], txt_dim=arch.joint_attention_dim, dtype=torch.bfloat16, sigma=[0.3, 0.8])
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with torch.no_grad():
        unfused = model(**inputs).sample
        calls: list[int] = []
        real = G.autograd.gemm_gate_residual
        monkeypatch.setattr(G.autograd, "gemm_gate_residual", lambda *a, **k: calls.append(1) or real(*a, **k))
        G.offer_gate_residual_fusion(True)
        try:
            impl, _ = resolve("mlp_down_gemm", torch.device("cuda"), torch.bfloat16, Runtime.STRICT)
            assert impl.fusions["adaln_gate_residual"] is not real  # the counting wrapper is what the model gets
            fused = model(**inputs).sample
        finally:
            G.offer_gate_residual_fusion(G.autograd.GATE_RESIDUAL_FUSION)
    assert len(calls) == 4 * arch.num_layers
    assert_bytes_equal(fused, unfused, "strict forward with the gated-residual epilogue vs unfused")


@pytest.mark.gpu
def test_gpu_checkpointed_step_runs_each_attention_forward_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpointed LoRA forward + backward at Qwen-Image's widths (2 blocks, uncaptured): the attention forward kernel
    runs once per block (its recompute takes the kept outputs) and the output and LoRA gradients keep the bytes of the
    step without checkpointing."""
    from mmdit_strict.config.schema import LoraConfig
    from mmdit_strict.trajectories.setup import attach_lora
    from tests.helpers import strict_qwen_image_cuda

    arch, model = strict_qwen_image_cuda(num_layers=2)
    attach_lora(model, LoraConfig(rank=16, alpha=16.0, init="random", seed=2))
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    model.enable_cuda_graphs(False)
    inputs = make_inputs(2, (32, 32), [77, 20], txt_dim=arch.joint_attention_dim, dtype=torch.bfloat16, sigma=[0.3, 0.8])
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    check_one_attention_forward_per_block(model, inputs, arch.num_layers, monkeypatch)


def check_one_attention_forward_per_block(model: MMDiT, inputs: dict[str, Any], blocks: int,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpointed step runs the Triton attention forward once per block (the recompute takes the kept outputs), as
    a plain step does, and its output and gradients are the plain step's bytes."""
    from mmdit_strict.kernels.triton import attention as A

    runs: list[int] = []
    real = A.attention_fwd
    monkeypatch.setattr(A, "attention_fwd", lambda *a, **k: runs.append(1) or real(*a, **k))
    steps = {}
    for checkpointing in (True, False):
        model.enable_gradient_checkpointing(checkpointing)
        runs.clear()
        steps[checkpointing] = _step(model, inputs)
        assert len(runs) == blocks, f"checkpointing={checkpointing}: {len(runs)} attention forwards"
    assert len(steps[True]) == len(steps[False]) > 2
    for i, (a, c) in enumerate(zip(steps[True], steps[False])):
        assert_bytes_equal(a, c, f"output / gradient {i}: checkpointed vs not")


def test_checkpointed_forward_names_each_attention_slot_for_its_recompute(tiny_ckpt, monkeypatch: pytest.MonkeyPatch) -> None:
    """The strict forward binds one ``KeptOutputs`` per checkpointed training forward and names each block's attention
    call in the forward and again in that block's recompute (the same store: the recompute runs in the forward's
    context); without checkpointing, or without autograd, none is bound."""
    from mmdit_strict.kernels.execution import current
    from mmdit_strict.kernels.kept_outputs import KeptOutputs

    seen: list[tuple[int, str]] = []
    real_at = KeptOutputs.at

    def at(self: KeptOutputs, slot: str):
        seen.append((id(self), slot))
        return real_at(self, slot)

    monkeypatch.setattr(KeptOutputs, "at", at)
    model = MMDiT.from_pretrained(tiny_ckpt[0], runtime="strict")
    blocks = len(model.transformer_blocks)
    inputs = make_inputs(2, (4, 4), [5, 3])
    model.enable_gradient_checkpointing(True)
    _step(model, inputs)
    slots = [f"block{i}.joint" for i in range(blocks)]
    assert [s for _, s in seen] == slots + slots[::-1]
    assert len({store for store, _ in seen}) == 1
    seen.clear()
    with torch.no_grad():
        model(**inputs)
    model.enable_gradient_checkpointing(True, keep_attention_outputs=False)  # the least memory: recomputed
    _step(model, inputs)
    model.enable_gradient_checkpointing(False)
    _step(model, inputs)
    assert seen == [] and current().kept_outputs is None

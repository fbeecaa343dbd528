"""The model and the execution context: the runtime is read from one place, and gradient-checkpoint
recomputes run in the forward's context whatever context the backward runs in."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mmdit_strict import MMDiT
from mmdit_strict.kernels.execution import ExecutionContext, Runtime, current, current_runtime, runtime_mode
from mmdit_strict.kernels.grad_sink import SampleGradSink, collect_sample_grads, sample_keys
from mmdit_strict.kernels.trace import capture_trace
from mmdit_strict.model import strict
from mmdit_strict.model.strict import capture_operators, inject_fault
from tests.harness import assert_bytes_equal
from tests.helpers import make_inputs

FAULT = "block1.img.mlp_down_gemm"


def _model(tiny_ckpt: Any, runtime: str, checkpointing: bool) -> MMDiT:
    model = MMDiT.from_pretrained(tiny_ckpt[0], runtime=runtime)
    model.enable_gradient_checkpointing(checkpointing)
    return model


def _grads_backward_outside(model: MMDiT, inputs: dict[str, Any], fault: str | None,
                            runtime: str | None = None) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Forward inside the blocks (runtime, fault), backward after leaving them; the output and every gradient."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    x = inputs["hidden_states"].clone().requires_grad_(True)
    with runtime_mode(runtime) if runtime is not None else _nothing(), inject_fault(fault):
        out = model(**{**inputs, "hidden_states": x}).sample
    out.square().sum().backward()
    return out.detach(), [x.grad] + [None if p.grad is None else p.grad.clone() for p in params]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_strict_recompute_sees_the_forward_context_without_a_snapshot(tiny_ckpt, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each block's recompute during backward runs in the very context object its forward ran in (runtime, fault,
    capture, grad sink and keys, trace, strict math), though the backward runs after every block was left."""
    model = _model(tiny_ckpt, "off", checkpointing=True)  # the default is off: only the context carries strict
    seen: list[tuple[ExecutionContext, bool]] = []
    real = strict.block_forward

    def spy(*args: Any) -> Any:
        seen.append((current(), torch.are_deterministic_algorithms_enabled()))
        return real(*args)

    monkeypatch.setattr(strict, "block_forward", spy)
    inputs = make_inputs(2, (4, 4), [5, 3])
    sink = SampleGradSink()
    with runtime_mode("strict"), capture_operators() as cap, inject_fault(FAULT), collect_sample_grads(sink), \
            sample_keys([10, 11]), capture_trace() as trace:
        out = model(**inputs).sample
    n = model.config.num_layers
    assert len(seen) == n, "one block call per block in the forward"
    outside = current()
    assert outside.runtime is None and not torch.are_deterministic_algorithms_enabled()
    out.square().sum().backward()
    assert len(seen) == 2 * n, "every block recomputed once during backward"
    for i in range(n):
        fwd, rec = seen[i], seen[n + i]
        assert rec[0] is fwd[0], f"block {i}: the recompute ran in another context"
        assert rec[1] and fwd[1], f"block {i}: strict math not pinned"
        ctx = fwd[0]
        assert ctx.runtime is Runtime.STRICT and ctx.fault == FAULT and ctx.capture is cap
        assert ctx.grad_sink is sink and ctx.sample_keys == (10, 11) and ctx.trace is trace
    assert current() is outside
    assert sink.stats.deposits > 0


@pytest.mark.parametrize("runtime", ["strict", "off"])
def test_recompute_plants_the_forward_fault_when_backward_runs_outside(tiny_ckpt, runtime: str) -> None:
    """Strict and production forwards: with checkpointing on, gradients of a faulted forward whose backward
    runs outside the fault's block equal those without checkpointing (the recompute plants the fault too)."""
    inputs = make_inputs(2, (4, 4), [5, 3])
    plain = _model(tiny_ckpt, runtime, checkpointing=False)
    ckpt = _model(tiny_ckpt, runtime, checkpointing=True)
    out_plain, g_plain = _grads_backward_outside(plain, inputs, FAULT)
    out_clean, g_clean = _grads_backward_outside(plain, inputs, None)
    assert not torch.equal(out_plain, out_clean), "the fault moved nothing"
    assert any(a is not None and not torch.equal(a, b) for a, b in zip(g_plain, g_clean)), "the fault moved no gradient"
    out_ckpt, g_ckpt = _grads_backward_outside(ckpt, inputs, FAULT)
    assert_bytes_equal(out_ckpt, out_plain, f"{runtime}: faulted forward with checkpointing vs without")
    for k, (a, b) in enumerate(zip(g_ckpt, g_plain)):
        assert_bytes_equal(a, b, f"{runtime}: gradient {k} with checkpointing vs without, backward outside the fault")


def test_the_forward_runs_in_the_context_runtime_else_the_model_default(tiny_ckpt) -> None:
    """One place decides the runtime: a caller's context wins over the model's default, which the forward
    enters only where no caller chose one; the model keeps no state of its own about the caller's choice."""
    model = MMDiT.from_pretrained(tiny_ckpt[0], runtime="strict")
    off_model = MMDiT.from_pretrained(tiny_ckpt[0], runtime="off")
    inputs = make_inputs(2, (4, 4), [5, 3])

    def run(m: MMDiT) -> tuple[torch.Tensor, set[tuple[str, str]]]:
        with capture_trace() as trace, torch.no_grad():
            out = m(**inputs).sample
        return out, {(r.requested, r.actual_backend) for r in trace.records.values()}

    assert model.runtime is Runtime.STRICT and current_runtime() is Runtime.OFF
    strict_out, strict_ran = run(model)
    assert strict_ran == {("strict", "cpu_strict")}, "the default entered for the model's operators"
    off_out, off_ran = run(off_model)
    assert off_ran == {("off", "torch")}
    with runtime_mode("off"):
        assert model.runtime is Runtime.OFF and model.default_runtime is Runtime.STRICT
        chosen_out, chosen_ran = run(model)
    assert chosen_ran == {("off", "torch")}, "the caller's runtime decides what runs"
    assert_bytes_equal(chosen_out, off_out, "a strict-default model in an off context vs an off model")
    with runtime_mode("strict"):
        assert_bytes_equal(run(off_model)[0], strict_out, "an off-default model in a strict context vs a strict model")
    assert model.runtime is Runtime.STRICT and off_model.runtime is Runtime.OFF
    off_model.runtime = "auto"  # assignment sets the default, as set_runtime does
    assert off_model.default_runtime is Runtime.AUTO and off_model.set_runtime("off") is off_model
    assert off_model.runtime is Runtime.OFF

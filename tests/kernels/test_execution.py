"""The execution context (kernels.execution): one frozen object in force, changed by entering copies of it."""

from __future__ import annotations

import threading

import pytest
import torch

from mmdit_strict.kernels.execution import (
    ExecutionContext, Layout, Runtime, current, current_runtime, execution, in_context, runtime_mode, using,
)
from mmdit_strict.kernels.grad_sink import SampleGradSink, active, collect_sample_grads, sample_keys
from mmdit_strict.kernels.keepalive import retain, retaining
from mmdit_strict.kernels.streams import GEMM_STREAM, current_gemm_stream, gemm_stream
from mmdit_strict.kernels.trace import active_trace, capture_trace
from mmdit_strict.model.strict import capture_operators, inject_fault, instrumented, record_gemms, uninstrumented


def test_outside_any_block_the_default_context_is_in_force() -> None:
    ctx = current()
    assert ctx.runtime is None and current_runtime() is Runtime.OFF
    assert ctx.gemm_stream == "image" and ctx.layout == Layout(0, 1)
    assert (ctx.fault, ctx.capture, ctx.gemm_calls, ctx.grad_sink, ctx.sample_keys, ctx.trace, ctx.keepalive) == (None,) * 7


def test_each_helper_enters_one_copy_and_the_previous_context_comes_back() -> None:
    """The public helpers set their field of one context; on exit (also on an error) the very object in force
    before is back."""
    outer = current()
    sink = SampleGradSink()
    with runtime_mode("audit") as mode, capture_trace() as trace, collect_sample_grads(sink), sample_keys([3, 1]), \
            retaining() as held, capture_operators() as cap, record_gemms() as calls, inject_fault("block0.img.x"):
        ctx = current()
        assert mode is Runtime.AUDIT and ctx.runtime is Runtime.AUDIT and current_runtime() is Runtime.AUDIT
        assert ctx.trace is trace and active_trace() is trace
        assert active() == (sink, (3, 1))
        assert ctx.keepalive is held and retain("table") == "table" and held == ["table"]
        assert ctx.capture is cap and ctx.gemm_calls is calls and ctx.fault == "block0.img.x" and instrumented()
        with uninstrumented():
            assert not instrumented() and current().trace is trace  # the rest of the context stays
        assert current() is ctx
        with pytest.raises(RuntimeError, match="inside"), execution(fault=None, layout=Layout(1, 2)):
            assert current().layout == Layout(1, 2) and current().capture is cap
            raise RuntimeError("inside")
        assert current() is ctx
    assert current() is outer


def test_replace_is_checked_like_a_new_context() -> None:
    ctx = ExecutionContext()
    with pytest.raises(ValueError, match="gemm stream must be one of"):
        ctx.replace(gemm_stream="audio")
    with pytest.raises(TypeError, match="Runtime.parse"):
        ctx.replace(runtime="strict")
    with pytest.raises(ValueError, match="rank < world"):
        Layout(rank=2, world=2)
    with pytest.raises(ValueError, match="unknown runtime"), execution(runtime="fast"):
        pass
    assert ctx.replace(runtime=Runtime.AUTO).runtime is Runtime.AUTO and ctx.runtime is None


def test_gemm_stream_switches_reuse_one_copy_per_context() -> None:
    """The strict model binds a stream around every product: the switched copy is made once and reused, and
    binding the stream already in force sets nothing."""
    base = current()
    with gemm_stream("text"):
        first = current()
        assert first.gemm_stream == "text" and current_gemm_stream() == "text"
        with gemm_stream("text"):
            assert current() is first
        with GEMM_STREAM.use("image"):
            assert current_gemm_stream() == "image" and GEMM_STREAM.current() == "image"
    with gemm_stream("text"):
        assert current() is first
    assert current() is base
    with pytest.raises(ValueError, match="gemm stream must be one of"):
        gemm_stream("txt")
    with pytest.raises(ValueError, match="gemm stream must be one of"):
        GEMM_STREAM.use("txt")


def test_entering_a_strict_runtime_pins_the_math_policy_and_off_does_not() -> None:
    before = torch.are_deterministic_algorithms_enabled()
    with execution(runtime="strict") as ctx:
        assert ctx.runtime is Runtime.STRICT and torch.are_deterministic_algorithms_enabled()
        assert torch.get_float32_matmul_precision() == "highest"
        with execution(runtime=Runtime.OFF):
            assert current_runtime() is Runtime.OFF
    assert torch.are_deterministic_algorithms_enabled() == before
    with using(ExecutionContext(runtime=Runtime.OFF)):
        assert torch.are_deterministic_algorithms_enabled() == before


def test_in_context_runs_a_later_call_in_the_held_context() -> None:
    """What a checkpoint recompute relies on: the held context, whatever is in force (or in which thread) at the call."""
    trace_seen: list[object] = []

    def probe() -> tuple[Runtime, str | None]:
        trace_seen.append(current().trace)
        return current_runtime(), current().fault

    with runtime_mode("strict"), inject_fault("k"), capture_trace() as trace:
        later = in_context(probe)
    assert later() == (Runtime.STRICT, "k")
    with runtime_mode("off"):
        assert later() == (Runtime.STRICT, "k")
    result: list[tuple[Runtime, str | None]] = []
    worker = threading.Thread(target=lambda: result.append(later()))
    worker.start()
    worker.join()
    assert result == [(Runtime.STRICT, "k")]
    assert trace_seen == [trace] * 3
    assert current().fault is None

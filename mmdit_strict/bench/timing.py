"""The timing and profiling the benches share: CUDA-graph and plain medians (``triton.testing``, imported on
first use) and the CUDA profiler's count of one call's GPU work."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

#: Host calls that put work on the GPU: the runtime's and the driver's kernel launches (Triton launches through
#: the driver) and a CUDA-graph replay (one call for a whole graph).
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel", "cuLaunchKernel",
                          "cuLaunchKernelEx", "cudaGraphLaunch"})


def cuda_profiler(teardown: bool = True, **kw: Any) -> Any:
    """``torch.profiler.profile(**kw)`` that tears CUPTI down when it stops (``TEARDOWN_CUPTI=1`` unless the
    environment sets it). Left subscribed, CUPTI's callbacks stay on every later driver call of the process:
    every launch after the first profiled call then costs more host time, which skews the uncaptured engines'
    timings taken after it (and Triton's launches, several driver calls each, more than PyTorch's).
    ``teardown=False`` (``TEARDOWN_CUPTI=0`` unless set) is for a process that times nothing after its profiles."""
    os.environ.setdefault("TEARDOWN_CUPTI", "1" if teardown else "0")
    from torch.profiler import profile

    return profile(**kw)


def kernel_stats(call: Callable[[Callable[[Any], None]], Any]) -> tuple[Any, list[int | None]]:
    """``call(on_launch)``'s result and ``[registers per thread, spilled registers]`` of the compiled kernel it hands
    ``on_launch`` (as the GEMM engine's ``on_launch=`` does); None where the backend reports none (the interpreter)."""
    seen: dict[str, Any] = {}
    out = call(lambda kernel: seen.update(regs=getattr(kernel, "n_regs", None), spills=getattr(kernel, "n_spills", None)))
    return out, [seen.get("regs"), seen.get("spills")]


def median_ms(result: Any) -> float:
    """The median of a ``do_bench`` / ``do_bench_cudagraph`` call asked for ``quantiles=[0.5]``: one quantile
    comes back as a float, or as a one-element list in other Triton versions."""
    return float(result[0] if isinstance(result, (list, tuple)) else result)


def graph_ms(fn: Callable[[], Any], rep: int) -> float | None:
    """Median ms of ``fn`` replayed from a CUDA graph over ``rep`` ms: GPU time without the host's launch
    cost. ``fn`` runs once first, outside the capture (compiles, fills caches). None where capture is not
    possible (a host synchronisation inside ``fn``, say): the caller reports its plain timings only."""
    from triton.testing import do_bench_cudagraph

    try:
        fn()
        torch.cuda.synchronize()
        return median_ms(do_bench_cudagraph(fn, rep=rep, quantiles=[0.5]))
    except Exception:  # noqa: BLE001 - capture not possible: no graph time
        return None


def plain_ms(fn: Callable[[], Any]) -> float:
    """Median ms of ``fn`` launched from the host (``do_bench``: 10 warm-up ms, 50 ms of runs): GPU and launch time."""
    from triton.testing import do_bench

    return median_ms(do_bench(fn, warmup=10, rep=50, quantiles=[0.5]))


def host_us(fn: Callable[[], Any], calls: int, warmup: int) -> float:
    """Host µs per call of ``fn``: ``warmup`` calls, a synchronisation, then ``perf_counter`` around ``calls`` calls
    (synchronised after, outside the clock). Meaningful where the GPU never holds the host back (small work per
    call): it then measures what the host pays to launch."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return us


@dataclass(frozen=True)
class GpuProfile:
    """What the CUDA profiler saw during one call.

    Attributes:
        device_events: kernels, copies and fills that ran on the GPU (a graph replay counts each of its kernels).
        host_launches: :data:`LAUNCH_CALLS` the host made (a graph replay counts once); 0 where the profiler
            recorded no host API calls.
        device_s: summed GPU time of ``device_events``, seconds.
    """

    device_events: int
    host_launches: int
    device_s: float


def gpu_profile(fn: Callable[[], Any]) -> tuple[Any, GpuProfile]:
    """``fn()``'s result and its :class:`GpuProfile` (the GPU is synchronised before the profiler stops)."""
    from torch.profiler import ProfilerActivity

    with cuda_profiler(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    events = prof.events()
    device = [e for e in events if e.device_type.name == "CUDA"]
    host = sum(1 for e in events if e.device_type.name == "CPU" and e.name in LAUNCH_CALLS)
    return out, GpuProfile(len(device), host, sum(e.time_range.elapsed_us() for e in device) * 1e-6)


GAP_CLASSES = ((0.0, 10.0), (10.0, 100.0), (100.0, float("inf")))  # µs


def gpu_gaps(activities: list[tuple[float, float, str]], top: int) -> dict[str, Any]:
    """Where the GPU waits during a call, from its activities ``(start µs, duration µs, name)``: the span (first
    start to last end), the union of busy time, the idle time between activities by gap size (:data:`GAP_CLASSES`;
    many small gaps: launch-bound, a few large ones: the host blocked or queued late) and the ``top`` largest gaps
    with the activities on either side. Times in ms, gaps in µs."""
    acts = sorted(activities)
    if not acts:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "classes": [], "largest": []}
    gaps: list[tuple[float, str, str]] = []
    busy, end, last = 0.0, acts[0][0], acts[0][2]
    for start, dur, name in acts:
        stop = start + dur
        if start > end:
            gaps.append((start - end, last[:60], name[:60]))
            busy += dur
        elif stop > end:
            busy += stop - end
        if stop >= end:
            end, last = stop, name
    span = end - acts[0][0]
    classes = [{"from_us": lo, "to_us": hi, "gaps": sum(1 for g in gaps if lo <= g[0] < hi),
                "idle_ms": sum(g[0] for g in gaps if lo <= g[0] < hi) / 1e3} for lo, hi in GAP_CLASSES]
    largest = [{"us": g, "after": a, "before": b} for g, a, b in sorted(gaps, key=lambda g: -g[0])[:top]]
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3, "classes": classes,
            "largest": largest}


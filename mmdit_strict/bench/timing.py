"""The CUDA-graph timing the qualification benches share (``triton.testing``, imported on first use)."""

from __future__ import annotations

from typing import Any, Callable

import torch


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

"""The survey's qualification of one implementation: raw-byte invariance, accuracy against the FP64
reference under our tolerance contract, and speed — the same checks for ours and for every peer.

Every check drives an :class:`~.impl.Impl` through :func:`execute`: samples packed stream by stream, one
forward and one backward with each sample's own upstream gradient (drawn from a generator keyed by the
sample, so a sample gets the same upstream gradient alone and in any batch), the outputs and the per-sample
input gradients cut back per sample.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .cases import Case
from .impl import Impl

Sample = tuple[torch.Tensor, ...]


@dataclass
class Result:
    """What :func:`execute` returns: per sample, its outputs then its input gradients; and the shared gradients."""

    per_sample: list[list[torch.Tensor]]
    shared_grads: list[torch.Tensor | None]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Raw-byte equality: same dtype and shape, and ``torch.equal`` of the bytes (so -0.0 ≠ 0.0 and NaN = its own bits)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def out_names(case: Case) -> list[str]:
    """The names outputs are reported under: ``out`` for one, ``out0``, ``out1`` … for several."""
    return ["out"] if len(case.out_streams) == 1 else [f"out{i}" for i in range(len(case.out_streams))]


def grad_names(case: Case) -> tuple[list[str], list[str]]:
    """The names of the per-sample and shared gradients, in :class:`Result` order."""
    ns = len(case.streams)
    return ([f"d{case.names[k]}" for k in range(ns) if case.grad_samples[k]],
            [f"d{case.names[ns + k]}" for k, g in enumerate(case.grad_shared) if g])


def seqlens_of(case: Case, samples: Sequence[Sample]) -> tuple[tuple[int, ...], ...]:
    """Rows per sample of each stream, read off the first tensor of that stream."""
    streams = sorted({s for s in case.streams if s is not None})
    first = {s: case.streams.index(s) for s in streams}
    return tuple(tuple(int(smp[first[s]].shape[0]) for smp in samples) for s in streams)


def _starts(lens: Sequence[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _split(t: torch.Tensor, stream: int | None, seqlens, b: int) -> torch.Tensor:
    if stream is None:
        return t[b:b + 1]
    st = _starts(seqlens[stream])
    return t[st[b]:st[b + 1]]


def upstream(key: int, shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """The upstream gradients of one sample's outputs: N(0, 1) from a generator seeded with ``key``."""
    g = torch.Generator(device=device).manual_seed(key)
    return [torch.randn(tuple(s), generator=g, device=device, dtype=torch.float32).to(dtype) for s in shapes]


def execute(case: Case, impl: Impl, samples: Sequence[Sample], keys: Sequence[int], shared: Sample,
            backward: bool = True) -> Result:
    """Run ``impl`` on the packed ``samples`` (forward, then backward with each sample's upstream gradient
    keyed by ``keys``) inside its context; return the per-sample outputs and gradients."""
    seqlens = seqlens_of(case, samples)
    packed = [torch.cat([s[k] for s in samples]).detach().clone().requires_grad_(backward and case.grad_samples[k])
              for k in range(len(case.streams))]
    sh = [t.detach().clone().requires_grad_(backward and case.grad_shared[i]) for i, t in enumerate(shared)]
    with impl.context(), torch.set_grad_enabled(backward):
        outs = tuple(impl.fn(*packed, *sh, seqlens=seqlens))
        per: list[list[torch.Tensor]] = [[_split(o.detach(), s, seqlens, b) for o, s in zip(outs, case.out_streams)]
                                         for b in range(len(samples))]
        if not backward:
            return Result(per, [])
        ups = [upstream(keys[b], [p.shape for p in per[b]], outs[0].dtype, outs[0].device) for b in range(len(samples))]
        gys = [torch.cat([ups[b][i] for b in range(len(samples))]) for i in range(len(outs))]
        leaves = [t for t in packed + sh if t.requires_grad]
        grads = list(torch.autograd.grad(outs, leaves, gys, allow_unused=True))
    it = iter(grads)
    g_packed = [next(it) if t.requires_grad else None for t in packed]
    g_shared = [next(it) if t.requires_grad else None for t in sh]
    for k, g in enumerate(g_packed):
        if g is None:
            continue
        for b in range(len(samples)):
            per[b].append(_split(g, case.streams[k], seqlens, b))
    return Result(per, g_shared)


# ------------------------------------------------------------------------------------------------ invariance


@dataclass(frozen=True)
class InvariancePlan:
    """Which batches the invariance section builds for one case.

    ``probe``: the probe sample's rows per stream; ``companions``: (lo, hi) rows per stream of the random
    companions; ``batches``: batch sizes (the probe first, in the middle and last of each); ``full_upto``:
    at batch sizes up to this every sample of the batch is compared with itself alone, above it the probe;
    ``pads``: growths of the companions' rows in ``pad_stream`` (what padding to a longer prompt changes).
    """

    probe: tuple[int, ...]
    companions: tuple[tuple[int, int], ...]
    batches: tuple[int, ...]
    pads: tuple[int, ...] = ()
    pad_stream: int = 0
    full_upto: int = 8


def invariance(case: Case, impl: Impl, dtype: torch.dtype, plan: InvariancePlan, shared: Sample,
               draw: Callable[[tuple[int, ...], int], Sample], seed: int) -> dict[str, Any]:
    """Raw-byte invariance of ``impl``: each compared sample's outputs and per-sample gradients in a batch
    against the same sample run alone (``torch.equal`` of the bytes). Returns the counts and the first failures."""
    rng = torch.Generator().manual_seed(seed)
    n_comp = max(plan.batches) + 2

    def rand_sizes() -> tuple[int, ...]:
        return tuple(int(torch.randint(lo, hi + 1, (1,), generator=rng)) for lo, hi in plan.companions)

    sizes = [plan.probe] + [rand_sizes() for _ in range(n_comp)]
    pool: dict[int, Sample] = {}

    def sample(i: int) -> Sample:
        if i not in pool:
            pool[i] = draw(sizes[i], seed * 100_003 + i)
        return pool[i]

    alone: dict[int, list[torch.Tensor]] = {}

    def alone_of(i: int) -> list[torch.Tensor]:
        if i not in alone:
            alone[i] = execute(case, impl, [sample(i)], [seed + i], shared).per_sample[0]
        return alone[i]

    checked = equal = 0
    failures: list[str] = []

    def compare(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
        nonlocal checked, equal
        for k, (a, b) in enumerate(zip(got, want)):
            checked += 1
            if same_bytes(a, b):
                equal += 1
            elif len(failures) < 8:
                failures.append(f"{what} tensor {k}")

    perm = torch.Generator().manual_seed(seed + 1)
    for B in plan.batches:
        others = (1 + torch.randperm(n_comp, generator=perm)[:B - 1]).tolist()
        for pos in sorted({0, (B - 1) // 2, B - 1}):
            ids = others[:pos] + [0] + others[pos:]
            res = execute(case, impl, [sample(i) for i in ids], [seed + i for i in ids], shared).per_sample
            for p, i in enumerate(ids):
                if B <= plan.full_upto or i == 0:
                    compare(res[p], alone_of(i), f"B={B} probe@{pos} sample {i}@{p}")
    for pad in plan.pads:
        comp = []
        for j in (1, 2):
            grown = list(sizes[j])
            grown[plan.pad_stream] += pad
            comp.append(draw(tuple(grown), seed * 7 + 1000 * pad + j))
        res = execute(case, impl, [sample(0)] + comp, [seed, seed + 10_001, seed + 10_002], shared).per_sample
        compare(res[0], alone_of(0), f"pad +{pad}")
    return {"checked": checked, "equal": equal, "failing": checked - equal, "failures": failures}


# ------------------------------------------------------------------------------------------------ accuracy


def reference(case: Case, samples: Sequence[Sample], keys: Sequence[int], shared: Sample,
              out_shapes: list[list[torch.Size]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The FP64 CPU reference on the same (rounded) inputs and upstream gradients: (outputs, gradients) in
    :func:`accuracy`'s tensor order."""
    seqlens = seqlens_of(case, samples)
    packed = [torch.cat([s[k] for s in samples]).detach().to("cpu", torch.float64).requires_grad_(case.grad_samples[k])
              for k in range(len(case.streams))]
    sh = [t.detach().to("cpu", torch.float64).requires_grad_(case.grad_shared[i]) for i, t in enumerate(shared)]
    dev = samples[0][0].device
    ups = [upstream(keys[b], out_shapes[b], samples[0][0].dtype, dev) for b in range(len(samples))]
    gys = [torch.cat([ups[b][i] for b in range(len(samples))]).to("cpu", torch.float64) for i in range(len(case.out_streams))]
    with torch.enable_grad():
        outs = tuple(case.ref(*packed, *sh, seqlens=seqlens))
        leaves = [t for t in packed + sh if t.requires_grad]
        grads = torch.autograd.grad(outs, leaves, gys, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]
    return [o.detach() for o in outs], list(grads)


def judge(case: Case, name: str, dname: str, actual: torch.Tensor | None, expected: torch.Tensor) -> dict[str, Any]:
    """One tensor against its FP64 reference under ``tolerances.yaml``: max abs error, max|ref|, and
    ``bound_ratio`` = max over elements of error / bound (≤ 1 passes; inf where the output is not finite)."""
    e = expected.detach().to("cpu", torch.float64)
    tol = case.tol(name, dname, e)
    if actual is None:
        return {"tensor": name, "pass": False, "max_abs": None, "max_ref": float(e.abs().max()), "bound_ratio": None,
                "note": "no gradient"}
    a = actual.detach().to("cpu", torch.float64).reshape(e.shape)
    ok, max_abs, _ = tol.check(a, e)
    bound = tol.atol + tol.rtol * e.abs()
    err = (a - e).abs()
    finite = bool(torch.isfinite(a).all())
    ratio = float((err / bound.clamp_min(1e-300)).max()) if e.numel() and finite else (0.0 if finite else float("inf"))
    return {"tensor": name, "pass": bool(ok), "max_abs": max_abs, "max_ref": float(e.abs().max()) if e.numel() else 0.0,
            "bound_ratio": ratio, "rtol": tol.rtol, "atol": tol.atol}


def accuracy(case: Case, impls: Sequence[Impl], dname: str, samples: Sequence[Sample], shared: Sample,
             seed: int) -> dict[str, list[dict[str, Any]]]:
    """Forward and every gradient of each implementation against one FP64 reference computed once for the batch."""
    keys = [seed + b for b in range(len(samples))]
    ref_cache: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    names = out_names(case) + [n for group in grad_names(case) for n in group]
    out: dict[str, list[dict[str, Any]]] = {}
    for impl in impls:
        res = execute(case, impl, samples, keys, shared)
        n_out = len(case.out_streams)
        if ref_cache is None:
            ref_cache = reference(case, samples, keys, shared, [[t.shape for t in p[:n_out]] for p in res.per_sample])
        ref_outs, ref_grads = ref_cache
        cat = [torch.cat([p[i] for p in res.per_sample]) for i in range(len(res.per_sample[0]))]
        actual = cat + [g for g, want in zip(res.shared_grads, case.grad_shared) if want]
        expected = ref_outs + ref_grads
        out[impl.name] = [judge(case, n, dname, a, e) for n, a, e in zip(names, actual, expected)]
    return out


# ------------------------------------------------------------------------------------------------ speed


def cpu_ms(fn: Callable[[], Any], reps: int = 5) -> float:
    """Median wall ms of ``fn`` on the host (one warm-up run first)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def speed(case: Case, impl: Impl, samples: Sequence[Sample], shared: Sample) -> dict[str, float | None]:
    """Forward and forward+backward time of ``impl`` on the packed ``samples`` (CUDA: CUDA-graph replay where
    capture works, else host-launched ``do_bench``; CPU: median wall time)."""
    seqlens = seqlens_of(case, samples)
    packed = [torch.cat([s[k] for s in samples]).detach().clone().requires_grad_(case.grad_samples[k]) for k in range(len(case.streams))]
    sh = [t.detach().clone().requires_grad_(case.grad_shared[i]) for i, t in enumerate(shared)]
    leaves = [t for t in packed + sh if t.requires_grad]
    with impl.context():
        outs0 = tuple(impl.fn(*[t.detach() for t in packed], *[t.detach() for t in sh], seqlens=seqlens))
        gys = [torch.randn_like(o) for o in outs0]

        def fwd() -> None:
            with torch.no_grad():
                impl.fn(*packed, *sh, seqlens=seqlens)

        def fwd_bwd() -> None:
            outs = tuple(impl.fn(*packed, *sh, seqlens=seqlens))
            torch.autograd.grad(outs, leaves, gys, allow_unused=True)

        if packed[0].device.type == "cuda":
            from ..timing import graph_ms, plain_ms

            res: dict[str, float | None] = {}
            for key, fn in (("fwd_ms", fwd), ("fwd_bwd_ms", fwd_bwd)):
                g = graph_ms(fn, rep=50)
                res[key] = g if g is not None else plain_ms(fn)
                res[key.replace("_ms", "_timing")] = "graph" if g is not None else "plain"  # type: ignore[assignment]
            return res
        return {"fwd_ms": cpu_ms(fwd), "fwd_bwd_ms": cpu_ms(fwd_bwd), "fwd_timing": "cpu", "fwd_bwd_timing": "cpu"}  # type: ignore[dict-item]

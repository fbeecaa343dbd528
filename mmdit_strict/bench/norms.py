"""Qualification of the strict row operators on the GPU: accuracy, raw-byte invariance and bandwidth.

``python -m mmdit_strict.bench.norms --out DIR`` (or ``mmdit-strict qualify --section norms``) writes
``norms.json`` and ``norms.md`` with, per operator and execution dtype (bf16, fp32):

* accuracy of the forward and every gradient against the FP64 CPU reference (``mmdit_strict.reference``)
  at 4096 / 6032 / 6889 image tokens (image-stream operators) with 0 / 128 / 256 text tokens
  (text-stream operators), bounded by ``tolerances.yaml`` ``row_ops.*``; the production PyTorch op's
  error in the same dtype is reported beside it;
* raw-byte invariance counts: every sample of a batch of B ∈ {2, 3, 8, 64} (a probe at the first, middle
  and last position among random companions) against the same sample alone, and the probe against
  companions whose lengths grow by 0..256 rows (what prompt padding changes in a padded layout);
  forward output and every per-row / per-sample gradient, ``torch.equal``;
* speed at B = 1 (4096 image rows, also 6889 in bf16; 256 text rows for the text input): forward and backward
  kernels' GPU time (CUDA-graph replay), the bytes they must move, GB/s and the fraction of the
  copy bandwidth measured in the same run for the same bytes (the faster of ``copy_`` and an SM copy,
  :mod:`.bandwidth`); our forward+backward
  against the eager PyTorch composition it replaces (``kernels/production.py``), both graph-replayed;
* the environment: GPU, driver, torch, Triton, CUDA, git commit.

Everything runs the product path (the frozen launch tables). Other launches of the same kernels are timed by
``python -m benchmarks.norms_tune`` (candidates in ``benchmarks/row_launches.py``).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..dtypes import EXECUTION_BY_SHORT_NAME as DTYPES
from ..environment import gpu_environment
from .bandwidth import copy_reference
from .timing import graph_ms, plain_ms

from mmdit_strict.tolerances import Tolerance, tolerance

from .norms_report import BATCHES, PADS, _f, render  # noqa: F401  (the report of this bench)

EPS = 1e-6
D, HEADS, HEAD_DIM, CT = 3072, 24, 128, 3584
IMAGE_TEXT = ((4096, 0), (6032, 128), (6889, 256))
DEVICE = "cuda"  # a CPU dry run of the accuracy / invariance logic (interpreter, fp32, small widths) swaps in "cpu"


def row_tolerance(check: str, dtype: torch.dtype | str, ref: torch.Tensor) -> Tolerance:
    """``tolerances.yaml`` ``row_ops.<check>.<dtype>`` resolved for ``ref``: its ``atol_max`` (a fraction of
    max|ref| of that tensor) turned into the absolute ``atol`` the report records."""
    return tolerance("row_ops", check, dtype).resolved(ref)


# ----------------------------------------------------------------------------------------------
# operator specs
# ----------------------------------------------------------------------------------------------


@dataclass
class Spec:
    """One operator as the bench drives it.

    ``sample(n, gen, dtype)`` draws one sample's own tensors (rows first; ``(1, ·)`` per-sample vectors);
    ``shared(gen, dtype)`` the tensors every sample shares (gains, weights); ``fn(*per_sample, *shared,
    seqlens=)`` runs it on packed samples; ``grad_samples`` / ``grad_shared`` say which get gradients.
    """

    name: str
    check: str
    stream: str  # "image" or "text"
    sample: Callable[..., tuple]
    shared: Callable[..., tuple]
    fn: Callable[..., torch.Tensor]
    ref: Callable[..., torch.Tensor]
    prod: Callable[..., torch.Tensor]
    grad_samples: tuple[bool, ...]
    grad_shared: tuple[bool, ...]
    bytes_fwd: Callable[[int, int], int] = lambda m, es: 0
    bytes_bwd: Callable[[int, int], int] = lambda m, es: 0
    bwd_kernel: Callable[..., Any] | None = None
    extra: dict = field(default_factory=dict)


def _randn(shape, gen, dtype, scale=1.0):
    return (scale * torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.float32)).to(dtype)


def _tables(n, gen):
    ang = 200.0 * torch.rand((n, HEAD_DIM // 2), generator=gen, device=DEVICE, dtype=torch.float64)
    return torch.cos(ang).float(), torch.sin(ang).float()


def _specs() -> list[Spec]:
    from mmdit_strict.kernels import production as P
    from mmdit_strict.kernels.triton import norms as N
    from mmdit_strict.kernels.triton import rope as R
    from mmdit_strict.reference import ops as ref

    def mod_sample(n, g, dt):
        return (_randn((n, D), g, dt), _randn((1, D), g, dt, 0.5), _randn((1, D), g, dt, 0.5))

    def gate_sample(n, g, dt):
        return (_randn((n, D), g, dt), _randn((n, D), g, dt), _randn((1, D), g, dt, 0.5))

    def qk_sample(n, g, dt):
        c, s = _tables(n, g)
        return (_randn((n, HEADS, HEAD_DIM), g, dt), c, s)

    def gain(g, dt, width=HEAD_DIM):
        return (1 + _randn((width,), g, torch.float32, 0.1)).to(dt)

    def qk_shared(g, dt):
        return (gain(g, dt),)

    def none(g, dt):
        return ()

    def final_sample(n, g, dt):
        return (_randn((n, D), g, dt), _randn((1, D), g, dt))

    def final_shared(g, dt):
        return (_randn((2 * D, D), g, dt, D**-0.5), _randn((2 * D,), g, dt, 0.1))

    def txt_sample(n, g, dt):
        return (_randn((n, CT), g, dt),)

    def txt_shared(g, dt):
        return (gain(g, dt, CT), _randn((D, CT), g, dt, CT**-0.5), _randn((D,), g, dt, 0.1))

    qk_elems = HEADS * HEAD_DIM
    return [
        Spec("adaln_modulation", "adaln_modulation", "both", mod_sample, none,
             lambda x, sh, sc, seqlens: N.adaln_modulation(x, sh, sc, seqlens=seqlens, eps=EPS),
             lambda x, sh, sc, seqlens: ref.adaln_modulation(x, sh, sc, seqlens, EPS),
             lambda x, sh, sc, seqlens: P.adaln_modulation(x, sh, sc, seqlens=seqlens, eps=EPS),
             (True, True, True), (), lambda m, es: 2 * m * D * es, lambda m, es: 3 * m * D * es),
        Spec("adaln_gate_residual", "adaln_gate_residual", "both", gate_sample, none,
             lambda x, y, gt, seqlens: N.adaln_gate_residual(x, y, gt, seqlens=seqlens),
             lambda x, y, gt, seqlens: ref.adaln_gate_residual(x, y, gt, seqlens),
             lambda x, y, gt, seqlens: P.adaln_gate_residual(x, y, gt, seqlens=seqlens),
             (True, True, True), (), lambda m, es: 3 * m * D * es, lambda m, es: 3 * m * D * es),
        Spec("qk_rmsnorm", "qk_rmsnorm", "both", qk_sample, qk_shared,
             lambda x, c, s, gn, seqlens: R.qk_rmsnorm(x, gn, seqlens=seqlens, eps=EPS),
             lambda x, c, s, gn, seqlens: ref.qk_rmsnorm(x, gn, EPS, seqlens=seqlens),
             lambda x, c, s, gn, seqlens: P.qk_rmsnorm(x, gn, seqlens=seqlens, eps=EPS),
             (True, False, False), (True,), lambda m, es: 2 * m * qk_elems * es, lambda m, es: 3 * m * qk_elems * es),
        Spec("multi_axis_rope", "multi_axis_rope", "both", qk_sample, none,
             lambda x, c, s, seqlens: R.multi_axis_rope(x, c, s),
             lambda x, c, s, seqlens: ref.multi_axis_rope(x, c, s),
             lambda x, c, s, seqlens: P.multi_axis_rope(x, c, s),
             (True, False, False), (), lambda m, es: 2 * m * qk_elems * es, lambda m, es: 2 * m * qk_elems * es),
        Spec("qk_rmsnorm_rope (fused)", "qk_rmsnorm_rope", "both", qk_sample, qk_shared,
             lambda x, c, s, gn, seqlens: R.qk_rmsnorm_rope(x, gn, c, s, seqlens=seqlens, eps=EPS),
             lambda x, c, s, gn, seqlens: ref.multi_axis_rope(ref.qk_rmsnorm(x, gn, EPS), c, s),
             lambda x, c, s, gn, seqlens: P.multi_axis_rope(P.qk_rmsnorm(x, gn, seqlens=seqlens, eps=EPS), c, s),
             (True, False, False), (True,), lambda m, es: 2 * m * qk_elems * es, lambda m, es: 3 * m * qk_elems * es),
        Spec("final_adaln_out", "final_adaln_out", "image", final_sample, final_shared,
             lambda x, t, w, b, seqlens: N.final_adaln_out(x, t, w, b, seqlens=seqlens, eps=EPS),
             lambda x, t, w, b, seqlens: ref.final_adaln_out(x, t, w, b, seqlens, EPS),
             lambda x, t, w, b, seqlens: P.final_adaln_out(x, t, w, b, seqlens=seqlens, eps=EPS),
             (True, True), (True, True), lambda m, es: (2 * m * D + 2 * D * D) * es, lambda m, es: (3 * m * D + 2 * 2 * D * D) * es),
        Spec("txt_in_rmsnorm_linear", "txt_in_rmsnorm_linear", "text", txt_sample, txt_shared,
             lambda x, gn, w, b, seqlens: N.txt_in_rmsnorm_linear(x, gn, w, b, seqlens=seqlens, eps=EPS),
             lambda x, gn, w, b, seqlens: ref.txt_in_rmsnorm_linear(x, gn, w, b, eps=EPS, seqlens=seqlens),
             lambda x, gn, w, b, seqlens: P.txt_in_rmsnorm_linear(x, gn, w, b, seqlens=seqlens, eps=EPS),
             (True,), (True, True, True), lambda m, es: (m * CT + m * D + D * CT) * es, lambda m, es: 0),
    ]


def _pack(spec: Spec, samples: list[tuple], shared: tuple, requires: bool):
    """Packed leaves for a batch: per-sample tensors concatenated (rows; vectors one row per sample)."""
    seqlens = tuple(int(s[0].shape[0]) for s in samples)
    packed = []
    for k in range(len(samples[0])):
        t = torch.cat([s[k] for s in samples]).detach().clone()
        packed.append(t.requires_grad_(requires and spec.grad_samples[k]))
    sh = [t.detach().clone().requires_grad_(requires and spec.grad_shared[i]) for i, t in enumerate(shared)]
    return seqlens, packed, sh


def _run(spec: Spec, fn, samples, shared, gy_rows, backward=True):
    """Forward (+ backward with the packed upstream gradient); returns (out, grads of per-sample inputs, grads of shared)."""
    seqlens, packed, sh = _pack(spec, samples, shared, backward)
    with torch.enable_grad() if backward else torch.no_grad():
        out = fn(*packed, *sh, seqlens=seqlens)
        if not backward:
            return seqlens, out, [], []
        leaves = [t for t in packed + sh if t.requires_grad]
        grads = torch.autograd.grad(out, leaves, gy_rows, allow_unused=True) if out.numel() or leaves else ()
    it = iter(grads)
    g_samples = [next(it) if t.requires_grad else None for t in packed]
    g_shared = [next(it) if t.requires_grad else None for t in sh]
    return seqlens, out.detach(), g_samples, g_shared


# ----------------------------------------------------------------------------------------------
# accuracy
# ----------------------------------------------------------------------------------------------


def _measure(actual: torch.Tensor | None, expected: torch.Tensor, peer: torch.Tensor | None, check: str, dname: str) -> dict:
    a = actual.detach().to("cpu", torch.float64) if actual is not None else torch.zeros_like(expected)
    e = expected.detach().to("cpu", torch.float64)
    tol = row_tolerance(check, dname, e)
    ok, max_abs, _ = tol.check(a, e)
    ref_norm = float(e.norm()) if e.numel() else 0.0
    row = {"check": check, "max_abs": max_abs, "max_ref": float(e.abs().max()) if e.numel() else 0.0,
           "rel_fro": float((a - e).norm()) / ref_norm if ref_norm else 0.0, "rtol": tol.rtol, "atol": tol.atol, "pass": bool(ok)}
    if peer is not None:
        p = peer.detach().to("cpu", torch.float64)
        row["torch_max_abs"] = float((p - e).abs().max()) if e.numel() else 0.0
    return row


def accuracy_case(spec: Spec, dname: str, rows: int, seed: int) -> list[dict]:
    dt = DTYPES[dname]
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    sample = spec.sample(rows, g, dt)
    shared = spec.shared(g, dt)
    seqlens = (rows,)
    gy = _randn((rows,) + tuple(spec_out_shape(spec, sample, shared)), g, dt)
    _, out, gs, gsh = _run(spec, spec.fn, [sample], shared, gy)
    _, pout, pgs, pgsh = _run(spec, spec.prod, [sample], shared, gy)
    # FP64 reference on the CPU from the same (rounded) inputs
    ref_in = [t.detach().to("cpu", torch.float64).requires_grad_(spec.grad_samples[k]) for k, t in enumerate(sample)]
    ref_sh = [t.detach().to("cpu", torch.float64).requires_grad_(spec.grad_shared[k]) for k, t in enumerate(shared)]
    with torch.enable_grad():
        rout = spec.ref(*ref_in, *ref_sh, seqlens=seqlens)
        leaves = [t for t in ref_in + ref_sh if t.requires_grad]
        rgrads = torch.autograd.grad(rout, leaves, gy.detach().to("cpu", torch.float64), allow_unused=True)
    rgrads = [torch.zeros_like(t) if r is None else r for t, r in zip(leaves, rgrads)]
    ours = [g for g in gs + gsh if g is not None]
    theirs = [g for g in pgs + pgsh if g is not None]
    names = [f"d_in{k}" for k, t in enumerate(sample) if spec.grad_samples[k]] + [f"d_shared{k}" for k, _ in enumerate(shared) if spec.grad_shared[k]]
    rows_out = [dict(_measure(out, rout, pout, spec.check, dname), tensor="out")]
    for name, a, e, p in zip(names, ours, rgrads, theirs):
        rows_out.append(dict(_measure(a, e, p, f"{spec.check}_grad", dname), tensor=name))
    for r in rows_out:
        r.update(op=spec.name, dtype=dname, rows=rows)
    return rows_out


def spec_out_shape(spec: Spec, sample: tuple, shared: tuple) -> tuple[int, ...]:
    with torch.no_grad():
        probe = spec.fn(*[t[:1] if t.shape[0] else t for t in sample], *shared, seqlens=(min(1, sample[0].shape[0]),))
    return tuple(probe.shape[1:])


# ----------------------------------------------------------------------------------------------
# raw-byte invariance
# ----------------------------------------------------------------------------------------------


def _per_sample(spec: Spec, seqlens, out, g_samples, samples) -> list[list[torch.Tensor]]:
    """Split a batch's outputs back per sample: out rows, and each per-sample input's gradient."""
    res: list[list[torch.Tensor]] = [[] for _ in seqlens]
    starts = [0]
    for n in seqlens:
        starts.append(starts[-1] + n)
    for b in range(len(seqlens)):
        res[b].append(out[starts[b]:starts[b + 1]])
    for k, g in enumerate(g_samples):
        if g is None:
            continue
        per_vec = not spec_row_input(spec, k)
        for b in range(len(seqlens)):
            res[b].append(g[b:b + 1] if per_vec else g[starts[b]:starts[b + 1]])
    return res


def spec_row_input(spec: Spec, k: int) -> bool:
    """Whether per-sample input ``k`` has one row per token (else one per sample)."""
    vec_inputs = {"adaln_modulation": (1, 2), "adaln_gate_residual": (2,), "final_adaln_out": (1,)}
    return k not in vec_inputs.get(spec.name, ())


def invariance_case(spec: Spec, dname: str, probe_rows: int, hi: int, seed: int) -> dict:
    dt = DTYPES[dname]
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    shared = spec.shared(g, dt)
    pool: list[tuple] = []
    lens = [probe_rows] + [int(v) for v in torch.randint(0 if spec.stream == "text" else 1, hi + 1, (max(BATCHES) + 8,),
                                                            generator=torch.Generator().manual_seed(seed))]
    for n in lens:
        pool.append(spec.sample(n, g, dt))
    tail = spec_out_shape(spec, pool[0], shared)
    gys = [_randn((n,) + tail, g, dt) for n in lens]
    cache: dict[int, list[torch.Tensor]] = {}

    def run(ids: list[int], samples=None, grads=None) -> list[list[torch.Tensor]]:
        ss = samples if samples is not None else [pool[i] for i in ids]
        gy = torch.cat(grads if grads is not None else [gys[i] for i in ids])
        seqlens, out, g_s, _ = _run(spec, spec.fn, ss, shared, gy)
        return _per_sample(spec, seqlens, out, g_s, ss)

    def alone(i: int) -> list[torch.Tensor]:
        if i not in cache:
            cache[i] = run([i])[0]
        return cache[i]

    checked = equal = 0
    failures: list[str] = []

    def compare(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
        nonlocal checked, equal
        for k, (a, b) in enumerate(zip(got, want)):
            checked += 1
            if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b):
                equal += 1
            elif len(failures) < 12:
                failures.append(f"{what} tensor {k}")

    perm = torch.Generator().manual_seed(seed + 1)
    for B in BATCHES:
        others = (1 + torch.randperm(len(pool) - 1, generator=perm)[:B - 1]).tolist()
        for pos in sorted({0, (B - 1) // 2, B - 1}):
            ids = others[:pos] + [0] + others[pos:]
            outs = run(ids)
            for p, i in enumerate(ids):
                compare(outs[p], alone(i), f"B={B} probe@{pos} sample {i}@{p}")
    # companions of growing length: what padding a batch to a longer prompt changes in a padded layout
    base = [pool[1], pool[2]]
    for pad in PADS:
        comp = []
        for s in base:
            n = int(s[0].shape[0]) + pad
            comp.append(spec.sample(n, torch.Generator(device=DEVICE).manual_seed(seed + 100 + n), dt))
        grads = [gys[0]] + [_randn((int(c[0].shape[0]),) + tail, g, dt) for c in comp]
        outs = run([], samples=[pool[0]] + comp, grads=grads)
        compare(outs[0], alone(0), f"pad +{pad}")
    return {"op": spec.name, "dtype": dname, "probe_rows": probe_rows, "companion_rows": [0 if spec.stream == "text" else 1, hi],
            "checked": checked, "equal": equal,
            "pass": checked == equal, "failures": failures}


# ----------------------------------------------------------------------------------------------
# speed
# ----------------------------------------------------------------------------------------------


def _graph_ms(fn, rep: int = 60) -> float | None:
    return graph_ms(fn, rep=rep)


def copy_gbps(total_bytes: int) -> float:
    """The copy bandwidth a kernel moving ``total_bytes`` (reads + writes) is compared with: the faster of
    ``dst.copy_(src)`` and an SM copy of those bytes, same run (:mod:`..bench.bandwidth`)."""
    return copy_reference(total_bytes, DEVICE).best


def _bwd_call(spec: Spec, sample: tuple, shared: tuple, gy: torch.Tensor):
    """The operator's backward kernels alone (no autograd), on saved forward state; None where not separate."""
    from mmdit_strict.kernels.triton import norms as N
    from mmdit_strict.kernels.triton import rope as R

    seq = (int(sample[0].shape[0]),)
    if spec.name == "adaln_modulation":
        x, sh, sc = sample
        _, mean, rstd = N.adaln_modulation_fwd(x, sh, sc, seq, EPS, store_stats=True)
        return lambda: N.adaln_modulation_bwd(gy, x, sc, mean, rstd, seq, True)
    if spec.name == "adaln_gate_residual":
        x, y, gt = sample
        return lambda: N.gate_residual_bwd(gy, y, gt, seq, True, True)
    if spec.name in ("qk_rmsnorm", "qk_rmsnorm_rope (fused)"):
        x, c, s = sample
        fused = spec.name != "qk_rmsnorm"
        _, rstd = R.qk_norm_fwd(x, shared[0], c if fused else None, s if fused else None, EPS, store_rstd=True)
        return lambda: R.qk_norm_bwd(gy, x, shared[0], rstd, c if fused else None, s if fused else None, seq, True)
    if spec.name == "multi_axis_rope":
        x, c, s = sample
        return lambda: R.rope_apply(gy, c, s, True)
    return None


def speed_case(spec: Spec, dname: str, rows: int, seed: int) -> dict:
    dt = DTYPES[dname]
    es = torch.empty((), dtype=dt).element_size()
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    sample = spec.sample(rows, g, dt)
    shared = spec.shared(g, dt)
    seq = (rows,)
    gy = _randn((rows,) + spec_out_shape(spec, sample, shared), g, dt)
    row: dict[str, Any] = {"op": spec.name, "dtype": dname, "rows": rows}

    def fwd(fn):
        return lambda: fn(*sample, *shared, seqlens=seq)

    leaves = [t.detach().clone().requires_grad_(r) for t, r in zip(sample, spec.grad_samples)]
    sh = [t.detach().clone().requires_grad_(r) for t, r in zip(shared, spec.grad_shared)]
    wrt = [t for t in leaves + sh if t.requires_grad]

    def fwd_bwd(fn):
        def run():
            out = fn(*leaves, *sh, seqlens=seq)
            torch.autograd.grad(out, wrt, gy)
        return run

    with torch.no_grad():
        row["fwd_ms"] = _graph_ms(fwd(spec.fn))
        row["torch_fwd_ms"] = _graph_ms(fwd(spec.prod))
    row["fwd_bwd_ms"] = _graph_ms(fwd_bwd(spec.fn))
    row["torch_fwd_bwd_ms"] = _graph_ms(fwd_bwd(spec.prod))
    with torch.no_grad():
        row["fwd_plain_ms"] = plain_ms(fwd(spec.fn))
        row["torch_fwd_plain_ms"] = plain_ms(fwd(spec.prod))
    row["fwd_bwd_plain_ms"] = plain_ms(fwd_bwd(spec.fn))
    row["torch_fwd_bwd_plain_ms"] = plain_ms(fwd_bwd(spec.prod))
    bwd = _bwd_call(spec, sample, shared, gy)
    if bwd is not None:
        row["bwd_ms"] = _graph_ms(bwd)
    for kind, nbytes_fn, ms_key in (("fwd", spec.bytes_fwd, "fwd_ms"), ("bwd", spec.bytes_bwd, "bwd_ms")):
        nbytes = nbytes_fn(rows, es)
        ms = row.get(ms_key)
        if nbytes and ms:
            gbps = nbytes / (ms * 1e-3) / 1e9
            cp = copy_reference(nbytes, DEVICE)
            row[f"{kind}_bytes"] = nbytes
            row[f"{kind}_gbps"] = gbps
            row[f"{kind}_copy_gbps"] = cp.best
            row[f"{kind}_copy_torch_gbps"] = cp.torch_gbps
            row[f"{kind}_copy_sm_gbps"] = cp.sm_gbps
            row[f"{kind}_fraction"] = gbps / cp.best
    for k in ("fwd", "fwd_bwd"):
        if row.get(f"{k}_ms") and row.get(f"torch_{k}_ms"):
            row[f"{k}_speedup_vs_torch"] = row[f"torch_{k}_ms"] / row[f"{k}_ms"]
    return row


def model_trace_case(layers: int = 2, grid: tuple[int, int] = (32, 32), txt_lens: tuple[int, ...] = (77, 5),
                     arch_name: str = "qwen-image", dtype: torch.dtype = torch.bfloat16) -> dict:
    """The qwen-image architecture (``layers`` blocks, random bf16 weights) in ``runtime=auto``: which
    operators fell back to PyTorch in a forward and a forward + backward, from the operator trace."""
    import dataclasses

    from mmdit_strict.config.arch import preset
    from mmdit_strict.kernels.trace import capture_trace
    from mmdit_strict.model.init import build_model
    from mmdit_strict.model.inputs import random_inputs

    arch = dataclasses.replace(preset(arch_name), num_layers=layers)
    model = build_model(arch, seed=0, runtime="auto", dtype=dtype, device=DEVICE)
    inp = {k: (v.to(DEVICE).to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
               else v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in random_inputs(arch, grid, txt_lens, seed=0).items()}
    res: dict[str, Any] = {"layers": layers, "grid": list(grid), "txt_lens": list(txt_lens), "dtype": str(dtype).replace("torch.", "")}
    for kind in ("forward", "forward+backward"):
        with capture_trace() as trace:
            if kind == "forward":
                with torch.no_grad():
                    model(**inp, return_dict=False)
            else:
                x = inp["hidden_states"].detach().clone().requires_grad_(True)
                out = model(**{**inp, "hidden_states": x}, return_dict=False)[0]
                out.float().sum().backward()
        res[kind] = sorted({f"{r.op} -> {r.actual_backend}" for r in trace.fallbacks})
        res[f"{kind}_backends"] = sorted({f"{r.op}: {r.actual_backend}" for r in trace.records.values()})
    del model
    return res


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------


def _env() -> dict:
    return gpu_environment()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="speed,accuracy,invariance,model",
                    help="comma list of speed, accuracy, invariance, model (the qwen-image architecture's fallbacks in runtime=auto)")
    ap.add_argument("--ops", default=None, help="comma list of operator names (default: all)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="skip remaining cases past this wall time")
    return _main(ap.parse_args(argv))


def _main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("the row-operator qualification needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    specs = [s for s in _specs() if args.ops is None or s.name in args.ops.split(",")]
    sections = args.sections.split(",")
    unknown = set(sections) - {"speed", "accuracy", "invariance", "model"}
    if unknown:
        raise SystemExit(f"--sections: unknown {sorted(unknown)}")
    report: dict[str, Any] = {"env": _env(), "accuracy": [], "invariance": [], "speed": [], "errors": []}

    def guarded(what: str, fn: Callable[[], Any]) -> Any:
        if time.time() - t0 > args.budget_s:
            report["errors"].append(f"{what}: skipped (wall-time budget {args.budget_s:.0f} s)")
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - record and continue: one broken case must not hide the others
            report["errors"].append(f"{what}: {type(exc).__name__}: {exc}")
            return None

    def flush() -> None:
        """Write the report as it stands (after each section and operator: a run cut short keeps what it measured)."""
        report["wall_s"] = time.time() - t0
        (out_dir / "norms.json").write_text(json.dumps(report, indent=1))
        (out_dir / "norms.md").write_text(render(report))

    if "speed" in sections:
        for spec in specs:
            for dname in DTYPES:
                for rows in ((256,) if spec.stream == "text" else (4096, 6889) if dname == "bf16" else (4096,)):
                    r = guarded(f"speed {spec.name} {dname} {rows}", lambda: speed_case(spec, dname, rows, 30))
                    if r:
                        report["speed"].append(r)
            flush()
    for spec in specs:
        for dname in DTYPES:
            if "accuracy" in sections:
                for i, (img, txt) in enumerate(IMAGE_TEXT):
                    for stream, rows in (("image", img), ("text", txt)):
                        if spec.stream not in (stream, "both"):
                            continue
                        r = guarded(f"accuracy {spec.name} {dname} {rows}", lambda: accuracy_case(spec, dname, rows, 10 + i))
                        report["accuracy"] += r or []
            if "invariance" in sections:
                probe, hi = (77, 256) if spec.stream == "text" else (4096, 1024)
                r = guarded(f"invariance {spec.name} {dname}", lambda: invariance_case(spec, dname, probe, hi, 20))
                if r:
                    report["invariance"].append(r)
            torch.cuda.empty_cache()
        flush()
    if "model" in sections:
        mt = guarded("model trace", model_trace_case)
        if mt:
            report["model_trace"] = mt
    flush()
    ok = all(a["pass"] for a in report["accuracy"] + report["invariance"]) and not report["errors"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

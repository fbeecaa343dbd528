"""Measurement of the K-split (row-parallel TP) formulation of the block's row-parallel layers, on a CUDA GPU.

    python -m mmdit_strict.bench.ksplit --out DIR [--sections accuracy,bytes,invariance,speed]
        [--dtypes bf16,fp32] [--splits 1,2,4,8] [--budget-s S]

Row-parallel TP cuts the reduction length K of the attention output (K = 3072 → N = 3072) and the MLP
down (K = 12288 → N = 3072) products over ``t`` ranks. Byte equality with one rank then needs one rank
to compute the same K-split sum (:mod:`mmdit_strict.kernels.ksplit`): ``t`` FP32 chunk products by the
strict GEMM engine under the layer's configuration, a fixed pairwise tree, the bias once, one cast. This
module measures that arithmetic beside the unsplit strict GEMM and cuBLAS, for ``t`` in ``--splits``, at
M = 4224 rows (4096 image + 128 text tokens, 1024², image-stream configuration) and M = 256 (text
stream), so the choice between it and the all-gather formulation (``docs/parallel.md``) rests on figures:

* ``accuracy``: against the FP64 CPU reference ``mmdit_strict.reference.ops.linear`` on 256 rows (the
  first and last 128; a row depends only on itself), under ``tolerances.yaml`` ``gemm.forward.<dtype>``
  (the engine's own forward contract, :func:`mmdit_strict.bench.gemm.gemm_tolerance`): max abs error,
  ``ratio`` = max over elements of ``|y − ref| / (atol + rtol·|ref|)`` (≤ 1 passes), for the K-split
  at every ``t``, the unsplit strict GEMM and ``F.linear`` (cuBLAS, TF32 off);
* ``bytes``: each ``t`` against the unsplit strict GEMM (elements that differ, expected 0 at ``t = 1``
  only), and the row-parallel emulation: the ``t`` rank shares computed from contiguous chunk copies
  (what each rank holds), folded by the same tree, equal in bytes to the one-rank K-split;
* ``invariance``: rows of M ∈ :data:`INVARIANCE_M` alone (batch start, end and offset 37) equal in
  bytes (``torch.equal``) to the same rows of the M = 4224 call, per ``t``;
* ``speed`` (median of ``triton.testing.do_bench``, and of a CUDA-graph replay): cuBLAS, the unsplit
  strict GEMM, the one-rank K-split (all ``t`` chunk products + tree + bias + cast), one rank's share (one
  chunk product, FP32 out: what a TP rank computes) and the tree + bias + cast alone;
* ``communication`` (computed, not measured), bytes one rank receives per layer call: row-parallel with
  every rank gathering the others' FP32 partials and summing in the tree order, ``(t−1)·M·N·4``; the
  column-sliced variant (each rank gathers and sums the partials of its ``N/t`` columns, then the cast
  output is all-gathered), ``(t−1)/t·M·N·(4 + e)``; the all-gather formulation's output gather
  ``(t−1)/t·M·N·e`` and, with the gather of its input (the attention heads, the MLP hidden rows) that
  the row-parallel layer does not need, ``(t−1)/t·M·(N + K)·e``.

Writes ``DIR/ksplit.json`` and ``DIR/ksplit.md`` (rewritten after each section; GPU, driver, torch,
Triton, commit in the header). The accuracy, bytes and invariance sections also run on the CPU with
tiny shapes through the Triton interpreter (``tests/bench/test_ksplit.py``); speed needs CUDA.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..dtypes import EXECUTION_BY_SHORT_NAME as DTYPES
from ..environment import environment_line, gpu_environment
from ..kernels import ksplit as KS
from . import markdown as md

#: (name, N, K) of the block's row-parallel layers (both carry a bias)
LAYERS = (("attn_out", 3072, 3072), ("mlp_down", 3072, 12288))
#: (name, M, GEMM stream): 4096 image + 128 text rows of one 1024² sample, and a 256-row text stream
ROW_CASES = (("image+text", 4224, "image"), ("text", 256, "text"))
INVARIANCE_M = (1, 7, 128, 129, 256, 1000, 4096)
ACCURACY_ROWS = 256  # the first and last 128 rows are compared with the FP64 reference
SECTIONS = ("accuracy", "bytes", "invariance", "speed")


def _dname(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def layer_inputs(n: int, k: int, m: int, dtype: torch.dtype, device: str, seed: int = 0):
    """``x (M, K)``, ``w (N, K)`` (nn.Linear's scale, 1/√K), ``b (N,)`` in ``dtype`` on ``device``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = 0.1 * torch.randn(n, generator=g)
    return tuple(v.to(device=device, dtype=dtype) for v in (x, w, b))


def communication(m: int, n: int, k: int, t: int, elem_bytes: int) -> dict:
    """Bytes one of ``t`` ranks receives per layer call (module docstring); computed, not measured."""
    share = (t - 1) / t
    return {"t": t, "M": m, "N": n, "K": k, "elem_bytes": elem_bytes,
            "row_parallel_gather_fp32": (t - 1) * m * n * 4,
            "row_parallel_column_sliced": share * m * n * (4 + elem_bytes),
            "allgather_output": share * m * n * elem_bytes,
            "allgather_input_and_output": share * m * (n + k) * elem_bytes}


def _bound_ratio(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> dict:
    """``y`` against the FP64 ``ref`` under ``gemm.forward.<dtype>``: max abs error, worst ratio to the bound, pass."""
    from .gemm import gemm_tolerance

    tol = gemm_tolerance("forward", dtype, ref)
    y64 = y.detach().to("cpu", torch.float64)
    err = (y64 - ref).abs()
    bound = tol.atol + tol.rtol * ref.abs()
    ok, max_abs, _ = tol.check(y, ref)
    return {"max_abs": max_abs, "ratio": float((err / bound).max()), "rel_fro": float(err.norm() / ref.norm().clamp_min(1e-300)),
            "pass": bool(ok), "rtol": tol.rtol, "atol": tol.atol}


def _unsplit(G, x, w, b, cfg):
    return G.gemm_fwd(x, w, b, config=cfg)[0]


def accuracy_case(name: str, n: int, k: int, m: int, stream: str, dtype: torch.dtype, splits: Sequence[int],
                  device: str) -> list[dict]:
    """Accuracy rows of one layer and row count: the K-split per ``t``, the unsplit strict GEMM, ``F.linear``."""
    from mmdit_strict.kernels.triton import gemm as G
    from mmdit_strict.reference import ops as ref_ops

    x, w, b = layer_inputs(n, k, m, dtype, device, seed=1)
    cfg = KS.layer_config(n, k, dtype, stream)
    half = ACCURACY_ROWS // 2
    rows = torch.cat([torch.arange(min(half, m)), torch.arange(max(m - half, 0), m)]).unique()
    ref = ref_ops.linear(x[rows.to(device)].cpu().double(), w.cpu().double(), b.cpu().double())
    with torch.no_grad():
        outs = [("cuBLAS F.linear" if device == "cuda" else "torch F.linear", None, F.linear(x, w, b)),
                ("strict unsplit", None, _unsplit(G, x, w, b, cfg))]
        for t in splits:
            outs.append((f"K-split t={t}", t, KS.ksplit_linear(x, KS.split_weight(w, t), b, t=t, engine="triton", config=cfg)))
    base = {"layer": name, "rows": f"{m} ({stream})", "M": m, "N": n, "K": k, "dtype": _dname(dtype), "rows_checked": len(rows)}
    return [dict(base, variant=v, t=t, **_bound_ratio(y[rows.to(device)], ref, dtype)) for v, t, y in outs]


def bytes_case(name: str, n: int, k: int, m: int, stream: str, dtype: torch.dtype, splits: Sequence[int],
               device: str) -> list[dict]:
    """Per ``t``: elements differing from the unsplit strict GEMM, and whether the ``t`` rank shares
    (contiguous chunk copies, one product each, FP32) folded by the same tree give the one-rank bytes."""
    from mmdit_strict.kernels.triton import gemm as G

    x, w, b = layer_inputs(n, k, m, dtype, device, seed=2)
    cfg = KS.layer_config(n, k, dtype, stream)
    rows = []
    with torch.no_grad():
        y0 = _unsplit(G, x, w, b, cfg)
        for t in splits:
            chunks = KS.split_weight(w, t)
            y = KS.ksplit_linear(x, chunks, b, t=t, engine="triton", config=cfg)
            shares = [KS.chunk_product(x[:, a:c].contiguous(), wc, engine="triton", config=cfg)
                      for (a, c), wc in zip(KS.chunk_bounds(k, t, cfg.BLOCK_K), chunks)]
            y_tp = (KS.tree_sum(shares) + b.float()).to(dtype)
            diff = y != y0
            rows.append({"layer": name, "rows": f"{m} ({stream})", "M": m, "N": n, "K": k, "dtype": _dname(dtype), "t": t,
                         "differing": int(diff.sum()), "elements": y.numel(),
                         "max_abs_diff": float((y.float() - y0.float()).abs().max()),
                         "tp_shares_equal": bool(torch.equal(y_tp, y))})
    return rows


def invariance_case(name: str, n: int, k: int, dtype: torch.dtype, splits: Sequence[int], device: str,
                    big_m: int = 4224, ms: Sequence[int] = INVARIANCE_M) -> list[dict]:
    """Per ``t``: rows of each M in ``ms`` alone (start, end, offset 37) vs the same rows of the ``big_m`` call."""
    x, w, b = layer_inputs(n, k, big_m, dtype, device, seed=3)
    cfg = KS.layer_config(n, k, dtype)
    out = []
    with torch.no_grad():
        for t in splits:
            chunks = KS.split_weight(w, t)
            y_big = KS.ksplit_linear(x, chunks, b, t=t, engine="triton", config=cfg)
            fails, checked = [], 0
            for m in ms:
                for where, start in (("start", 0), ("end", big_m - m), ("offset37", 37)):
                    if start < 0 or start + m > big_m:
                        continue
                    y = KS.ksplit_linear(x[start:start + m].contiguous(), chunks, b, t=t, engine="triton", config=cfg)
                    checked += 1
                    if not torch.equal(y, y_big[start:start + m]):
                        fails.append(f"M={m} {where}")
            out.append({"layer": name, "N": n, "K": k, "dtype": _dname(dtype), "t": t, "big_M": big_m,
                        "checked": checked, "pass": not fails, "failures": fails[:20]})
    return out


def speed_case(name: str, n: int, k: int, m: int, stream: str, dtype: torch.dtype, splits: Sequence[int]) -> list[dict]:
    """Median ms (``do_bench``, CUDA graph) of cuBLAS, the unsplit strict GEMM and, per ``t``, the one-rank
    K-split, one rank's share and the tree + bias + cast alone (CUDA only)."""
    from mmdit_strict.kernels.triton import gemm as G

    from .timing import graph_ms, plain_ms

    x, w, b = layer_inputs(n, k, m, dtype, "cuda", seed=4)
    cfg = KS.layer_config(n, k, dtype, stream)
    flops = 2.0 * m * n * k
    rows = []

    def timed(variant: str, t: int | None, fn, work: float) -> None:
        fn()  # compile, pack, fill caches: untimed
        ms, gms = plain_ms(fn), graph_ms(fn, rep=100)
        rows.append({"layer": name, "rows": f"{m} ({stream})", "M": m, "N": n, "K": k, "dtype": _dname(dtype),
                     "variant": variant, "t": t, "ms": ms, "graph_ms": gms,
                     "tflops": work / (gms or ms) / 1e9 if work else None})

    with torch.no_grad():
        timed("cuBLAS F.linear", None, lambda: F.linear(x, w, b), flops)
        timed("strict unsplit", None, lambda: _unsplit(G, x, w, b, cfg), flops)
        for t in splits:
            chunks = KS.split_weight(w, t)
            timed("K-split one rank", t, lambda c=chunks, t=t: KS.ksplit_linear(x, c, b, t=t, engine="triton", config=cfg), flops)
            if t > 1:
                kc = k // t
                x0 = x[:, :kc].contiguous()
                timed("one rank's share", t, lambda c=chunks[0], x0=x0: KS.chunk_product(x0, c, engine="triton", config=cfg),
                      flops / t)
                parts = [torch.randn(m, n, device="cuda") for _ in range(t)]
                timed("tree + bias + cast", t, lambda p=parts: (KS.tree_sum(p) + b.float()).to(dtype), 0.0)
    torch.cuda.synchronize()
    by = {r["variant"]: r for r in rows if r["t"] is None}
    tk = "graph_ms" if all(r["graph_ms"] for r in rows) else "ms"
    for r in rows:
        r["timed_by"] = tk
        r["vs_cublas"] = by["cuBLAS F.linear"][tk] / r[tk]
        r["vs_unsplit"] = by["strict unsplit"][tk] / r[tk]
    return rows


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def _mb(v: float) -> str:
    return f"{v / 1e6:.1f}"


def _t(t) -> str:
    return "—" if t is None else str(t)


def render(report: dict) -> str:
    """The Markdown report of a result dict (``env``, the section row lists, ``communication``, ``errors``)."""
    from .gemm import md_footer

    e = report.get("env", {})
    lines = ["# K-split (row-parallel TP) GEMM arithmetic — measurement", "",
             environment_line(e, f"TF32 {e.get('tf32')}"), "",
             "One-rank K-split: `y = cast(tree_j(X[:, K_j] W[:, K_j]ᵀ) + b)`, t equal contiguous K chunks, each an FP32 "
             "strict-GEMM product under the whole layer's configuration, the fixed pairwise tree of "
             "`kernels/fold_tree.py`, the bias once, one cast (`mmdit_strict/kernels/ksplit.py`).", ""]
    lines += md.rows_section(
        report.get("accuracy"), lambda rows: f"Accuracy vs FP64 ({md.passed(rows)})",
        ("layer", "rows", "dtype", "variant", "max abs", "ratio to bound", "rel-fro", "pass"),
        lambda a: md.row(a["layer"], a["rows"], a["dtype"], a["variant"], f"{a['max_abs']:.3e}", f"{a['ratio']:.3f}",
                         f"{a['rel_fro']:.2e}", "PASS" if a["pass"] else "FAIL"),
        ["Bound: tolerances.yaml `gemm.forward.<dtype>`, `|y − ref| ≤ rtol·|ref| + atol_max·max|ref|` elementwise; "
         "ratio = max of `|y − ref| / bound` (≤ 1 passes), on the first and last 128 rows."])
    lines += md.rows_section(
        report.get("bytes"), "Bytes against the unsplit strict GEMM, and the rank shares",
        ("layer", "rows", "dtype", "t", "differing elements", "of", "max abs diff", "t rank shares = one rank"),
        lambda r: md.row(r["layer"], r["rows"], r["dtype"], r["t"], r["differing"], r["elements"], f"{r['max_abs_diff']:.3e}",
                         "equal" if r["tp_shares_equal"] else "DIFFER"),
        ["t = 1 is the unsplit product with the epilogue outside the kernel (expected: 0 differing); t > 1 is another "
         "reduction tree (expected to differ). Rank shares: each chunk computed from contiguous copies (what a rank "
         "holds), folded by the same tree, against the one-rank K-split (torch.equal)."])
    lines += md.rows_section(
        report.get("invariance"), lambda rows: f"Raw-byte batch invariance ({md.passed(rows)})",
        ("layer", "dtype", "t", "checked", "pass", "failures"),
        lambda r: md.row(r["layer"], r["dtype"], r["t"], r["checked"], "PASS" if r["pass"] else "FAIL", ", ".join(r["failures"][:4])),
        [f"Rows of M ∈ {list(INVARIANCE_M)} alone (batch start, end, offset 37) vs the same rows of the M = 4224 call."])
    lines += md.rows_section(
        report.get("speed"), "Speed (ratios: that time / this time, > 1 is faster)",
        ("layer", "rows", "dtype", "variant", "t", "ms", "graph ms", "TFLOP/s", "vs cuBLAS", "vs unsplit"),
        lambda r: md.row(r["layer"], r["rows"], r["dtype"], r["variant"], _t(r["t"]), f"{r['ms']:.4f}",
                         "—" if r["graph_ms"] is None else f"{r['graph_ms']:.4f}",
                         "—" if r["tflops"] is None else f"{r['tflops']:.1f}", f"{r['vs_cublas']:.2f}", f"{r['vs_unsplit']:.2f}"),
        ["`do_bench` medians include the host's launch cost; graph: one CUDA-graph replay (GPU time; — where capture "
         "failed); ratios and TFLOP/s use the graph time where every row has one. One rank's share: one chunk's product "
         "(FP32 out), the work of one TP rank; its TFLOP/s count that chunk's flops."])
    lines += md.rows_section(
        report.get("communication"), "Communication per layer call, MB one rank receives (computed, not measured)",
        ("layer", "rows", "dtype", "t", "row-parallel: gather FP32 partials", "row-parallel: column-sliced",
         "all-gather: output", "all-gather: input + output"),
        lambda c: md.row(c["layer"], c["rows"], c["dtype"], c["t"], _mb(c["row_parallel_gather_fp32"]),
                         _mb(c["row_parallel_column_sliced"]), _mb(c["allgather_output"]), _mb(c["allgather_input_and_output"])),
        ["Row-parallel: `(t−1)·M·N·4` (every rank sums all partials in the tree order) or `(t−1)/t·M·N·(4+e)` (each "
         "rank sums its N/t columns, then the cast output is gathered); all-gather formulation: `(t−1)/t·M·N·e` for "
         "the output, `(t−1)/t·M·(N+K)·e` with the gather of the layer's input."])
    return "\n".join(lines + md_footer(report)) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    from .gemm import ReportWriter, cuda_setup

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--dtypes", default="bf16,fp32", help="comma list of bf16, fp32")
    ap.add_argument("--splits", default=",".join(map(str, KS.SPLITS)), help="comma list of chunk counts t")
    ap.add_argument("--budget-s", type=float, default=100.0, help="skip remaining cases past this wall time")
    args = ap.parse_args(argv)
    cuda_setup("the K-split measurement")
    sections = set(args.sections.split(","))
    unknown = sections - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    splits = tuple(int(s) for s in args.splits.split(","))
    dtypes = [DTYPES[d] for d in ("bf16", "fp32") if d in args.dtypes.split(",")]
    report: dict = {"env": gpu_environment(), "splits": list(splits), "accuracy": [], "bytes": [], "invariance": [],
                    "speed": [], "communication": [], "errors": []}
    for dtype in dtypes:
        for name, n, k in LAYERS:
            for rname, m, _ in ROW_CASES:
                for t in splits:
                    report["communication"].append(
                        dict(communication(m, n, k, t, dtype.itemsize), layer=name, rows=f"{m} ({rname})", dtype=_dname(dtype)))
    run = ReportWriter(args.out, "ksplit", report, render, args.budget_s)
    for dtype in dtypes:  # bf16 (the production dtype) whole before fp32; within it the speed headline first
        dn = _dname(dtype)
        if "speed" in sections:
            for (name, n, k), (_, m, stream) in ((layer, rc) for layer in LAYERS for rc in ROW_CASES):
                report["speed"] += run.guarded(f"speed {name} {dn} M={m}", lambda: speed_case(name, n, k, m, stream, dtype, splits))
            run.save()
        for section, fn in (("accuracy", accuracy_case), ("bytes", bytes_case)):
            if section in sections:
                for (name, n, k), (_, m, stream) in ((layer, rc) for layer in LAYERS for rc in ROW_CASES):
                    report[section] += run.guarded(f"{section} {name} {dn} M={m}",
                                                   lambda: fn(name, n, k, m, stream, dtype, splits, "cuda"))
                run.save()
        if "invariance" in sections:
            for name, n, k in LAYERS:
                report["invariance"] += run.guarded(f"invariance {name} {dn}", lambda: invariance_case(name, n, k, dtype, splits, "cuda"))
            run.save()
    return run.finish()


if __name__ == "__main__":
    raise SystemExit(main())

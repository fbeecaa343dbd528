"""Configuration sweeps of the strict GEMM engine on a CUDA GPU (tuning history; informational).

    python -m benchmarks.gemm_sweeps --out DIR --sweep big|small|round2|round3|round5|text|vector [--classes NxK,...]

Run from the repository root (this folder is not part of the installed package). Each candidate is a
:class:`~mmdit_strict.kernels.triton.configs.FwdConfig` passed to the engine explicitly
(``gemm_fwd(config=...)``, ``gemm_bwd(dx_config=...)``); ``configs`` is never edited, so a winner
becomes the engine's configuration only by an edit of configs.py followed by ``mmdit-strict qualify``.
Candidates change tiles, never the reduction order's dependence on M. The rounds' reports are under
experiments/gemm/ (NOTES.md tells the story):

* ``big``: six tiles for the four M = 4224 layers (run 1); ``small``: the weight-streaming classes;
* ``round2``: per (N, K) class, fwd and dX uses scored together (the first candidate is the incumbent);
  ``text``: the text stream's products at prompt-sized row counts, candidates vs the incumbent's bytes;
  ``vector``: the same for the per-sample products (modulation projections at 1-8 rows) and txt_in in FP32;
  ``round3``: the tanh-GELU class; ``round5``: the persistent tile walk. Writes ``sweeps.json`` / ``sweeps.md``.
"""

from __future__ import annotations

import argparse

import torch

from mmdit_strict.environment import environment_line
from mmdit_strict.bench.gemm import (
    DEVICE,
    ReportWriter,
    _bench,
    _bench_graph,
    _cfg_str,
    _env,
    _torch_linear,
    _weights,
    cuda_setup,
    md_footer,
)
from mmdit_strict.bench.timing import kernel_stats
from mmdit_strict.kernels.triton.configs import FwdConfig

# The shapes the tuning rounds swept, as they were written then (name, N, K, bias, prologue, epilogue,
# M values). Not the model's classes: ``qkv`` is the concatenated 9216-wide Q/K/V product of runs 1-5,
# while the model runs three 3072-wide ones (``mmdit_strict.bench.gemm_shapes`` reads the classes the
# qualification measures from a strict forward).
LAYERS = [
    ("qkv", 9216, 3072, True, "none", "none", (4224,)),
    ("attn_out", 3072, 3072, True, "none", "none", (4224,)),
    ("mlp_up", 12288, 3072, True, "none", "gelu_tanh", (4224,)),
    ("mlp_down", 3072, 12288, True, "none", "none", (4224,)),
    ("mod", 18432, 3072, True, "silu", "none", (1, 8)),
    ("final_mod", 6144, 3072, True, "silu", "none", (1, 8)),
    ("txt_in", 3072, 3584, True, "none", "none", (4224,)),
    ("img_in", 3072, 64, True, "none", "none", (4224,)),
    ("proj_out", 64, 3072, True, "none", "none", (4224,)),
    ("temb_1", 3072, 256, True, "none", "silu", (1, 8)),  # timestep MLP linear_1 (+ SiLU), one row per sample
]


def _cand(bm, bn, bk, warps, stages, group_m=8, layout="kn", **extra) -> FwdConfig:
    """A forward candidate: BLOCK_M, BLOCK_N, BLOCK_K, warps, stages (GROUP_M 8 and the Wᵀ-copy read unless given)."""
    return FwdConfig(bm, bn, bk, warps, stages, weight_layout=layout, GROUP_M=group_m, **extra)


SWEEP = [
    _cand(128, 256, 64, 8, 3),
    _cand(128, 256, 64, 8, 4),
    _cand(128, 256, 64, 8, 3, layout="nk"),
    _cand(256, 128, 64, 8, 3),
    _cand(128, 128, 64, 4, 4),
    _cand(128, 128, 64, 8, 4),
]


SWEEP_SMALL = [  # weight-streaming classes (modulation fwd/dX at M = 8, N = 64 at M = 4224)
    _cand(16, 64, 64, 4, 4),
    _cand(16, 32, 128, 4, 4),
    _cand(16, 64, 128, 4, 3),
    _cand(16, 128, 64, 4, 4),
    _cand(16, 64, 64, 4, 4, layout="nk"),
    _cand(32, 64, 64, 4, 4),
]


# Round 2 (experiments/gemm/NOTES.md): M = 4224 classes (fwd and dX), the first entry is the incumbent.
ROUND2_BIG = [
    _cand(128, 256, 64, 8, 4), _cand(128, 256, 64, 8, 3), _cand(128, 256, 64, 8, 4, group_m=16),
    _cand(256, 128, 64, 8, 3), _cand(128, 128, 64, 4, 3), _cand(128, 256, 64, 8, 4, tma=True),
    _cand(256, 128, 64, 8, 3, tma=True),
]
# Weight-streaming classes at M = 8 (modulation fwd with the SiLU prologue pass; its dX).
ROUND2_MOD_FWD = [
    _cand(16, 64, 64, 4, 4), _cand(16, 128, 64, 4, 4), _cand(16, 64, 128, 4, 4), _cand(16, 128, 128, 4, 3),
    _cand(16, 64, 256, 4, 3), _cand(16, 32, 256, 4, 4), _cand(16, 128, 64, 4, 6), _cand(16, 256, 64, 8, 4),
    _cand(16, 64, 128, 4, 4, layout="nk"), _cand(16, 128, 64, 4, 4, layout="nk"), _cand(16, 64, 256, 4, 3, layout="nk"),
]
ROUND2_MOD_DX = [
    _cand(16, 32, 128, 4, 4), _cand(16, 16, 256, 4, 4), _cand(16, 32, 256, 4, 3), _cand(16, 16, 128, 4, 6),
    _cand(16, 16, 512, 4, 3), _cand(16, 32, 128, 4, 6),
]


# Round 3: the GELU-epilogue class (12288, 3072) — mlp_up fwd, mlp_down dX. Tiles with ≤ 96 KB of
# shared memory fit two programs per SM, so one program's epilogue overlaps another's main loop.
ROUND3_BIG = [
    _cand(128, 256, 64, 8, 4, tma=True), _cand(128, 256, 64, 8, 3, tma=True), _cand(128, 128, 64, 8, 3, tma=True),
    _cand(128, 128, 64, 4, 3, tma=True), _cand(128, 128, 64, 8, 4, tma=True), _cand(128, 256, 64, 8, 4, group_m=16, tma=True),
    _cand(128, 128, 128, 8, 2, tma=True),
]


# Round 4 (commit 7cf2678, experiments/gemm/NOTES.md) swept the GELU class over epilogue column parts,
# a Newton division (since adopted for every activation), a TMA store and a persistent tile walk.
# Round 5: the persistent walk for every M = 4224 class; the first entry is each class's incumbent.
_T = dict(tma=True)
ROUND5_BIG = [
    _cand(128, 256, 64, 8, 4, **_T), _cand(128, 256, 64, 8, 4, persistent=True, **_T),
    _cand(128, 256, 64, 8, 4, persistent=True, epi_split=2, **_T),
    _cand(128, 256, 64, 8, 3, persistent=True, epi_split=2, tma_store=True, **_T),
]


# Text-stream rows (acf771d, experiments/gemm/NOTES.md): every block runs its text-stream products on the
# prompt's 128-256 rows with the big-class tile, 12 programs on 132 SMs at 128 rows, 0.24-0.26x cuBLAS.
# A configuration for those products would be chosen by the layer's stream, never by the row count.
# Candidates with more programs at 128 rows; BLOCK_K stays 64 (the K steps of the incumbent), and the
# sweep compares every candidate's output bytes with the incumbent's.
TEXT_LAYERS = [  # (name, N, K, bias, prologue, epilogue): the text stream's per-block products and txt_in
    ("qkv", 3072, 3072, True, "none", "none"),
    ("attn_out", 3072, 3072, True, "none", "none"),
    ("mlp_up", 12288, 3072, True, "none", "gelu_tanh"),
    ("mlp_down", 3072, 12288, True, "none", "none"),
    ("txt_in", 3072, 3584, True, "none", "none"),
]
TEXT_ROWS = (128, 144, 256)
_NK_TMA = dict(layout="nk", tma=True)
TEXT_SWEEP = [
    _cand(64, 128, 64, 4, 4, **_NK_TMA),
    _cand(64, 64, 64, 4, 4, **_NK_TMA),
    _cand(128, 64, 64, 4, 4, **_NK_TMA),
    _cand(64, 256, 64, 8, 3, **_NK_TMA),
    _cand(64, 128, 64, 4, 3, layout="nk"),
    _cand(32, 128, 64, 4, 4, layout="nk"),
]


# Per-sample products (M = batch rows, weight-streaming): the final modulation (6144×3072, K step 128) and the
# blocks' modulation projections (18432×3072, K step 64) at 1, 2 and 8 rows, and txt_in in FP32 (0.74x eager at
# c893898) at prompt rows. Narrower tiles give more programs for the weight stream; each keeps its class's K step.
_NK = dict(layout="nk")
VECTOR_CASES = [  # (name, N, K, bias, prologue, epilogue, dtype, rows, candidates)
    ("final_mod", 6144, 3072, True, "silu", "none", torch.bfloat16, (1, 2, 8), [
        _cand(16, 32, 128, 4, 4, **_NK_TMA), _cand(16, 32, 128, 4, 6, **_NK_TMA), _cand(16, 64, 128, 4, 6, **_NK_TMA),
        _cand(16, 32, 128, 2, 4, **_NK_TMA), _cand(16, 64, 128, 8, 4, **_NK_TMA)]),
    ("mod", 18432, 3072, True, "silu", "none", torch.bfloat16, (1, 2, 8), [
        _cand(16, 128, 64, 4, 4, **_NK_TMA), _cand(16, 128, 64, 4, 6, **_NK_TMA), _cand(16, 64, 64, 4, 6, **_NK_TMA),
        _cand(16, 256, 64, 8, 6, **_NK_TMA)]),
    ("txt_in", 3072, 3584, True, "none", "none", torch.float32, (128, 256), [
        _cand(32, 64, 32, 4, 3, **_NK), _cand(32, 128, 32, 4, 3, **_NK), _cand(64, 64, 32, 4, 3, **_NK),
        _cand(16, 64, 32, 4, 4, **_NK), _cand(32, 64, 32, 2, 4, **_NK)]),
]


def text_sweep(G, C, report, save, budget_ok, candidates=None, rows=TEXT_ROWS, cases=None) -> None:
    """Time the text-stream products (forward) at prompt-sized ``rows`` — or ``cases``: (name, N, K, bias,
    prologue, epilogue, dtype, rows, candidates) — for the incumbent configuration and each candidate, beside
    cuBLAS, all in CUDA-graph time; record whether each candidate's output equals the incumbent's in bytes
    (``bytes_equal_incumbent``). Informational: adopting a candidate is a stream-keyed configuration, an edit
    of the engine and a qualification run."""
    text = cases is None
    if text:
        cases = [(*layer, torch.bfloat16, rows, candidates or TEXT_SWEEP) for layer in TEXT_LAYERS]
    for (name, n, k, bias, pro, epi, dt, case_rows, cands) in cases:
        if not budget_ok():
            report["errors"].append(f"text sweep: budget reached before {name}")
            break
        w, b, _ = _weights(n, k, dt, bias, gen_seed=11)
        incumbent = C.fwd_config(n, k, dt)
        for m in case_rows:
            x = torch.randn(m, k, device=DEVICE).to(dt)
            with torch.no_grad():
                base = G.gemm_fwd(x, w, b, prologue=pro, epilogue=epi, config=incumbent)[0]
                ref_ms = _bench_graph(lambda: _torch_linear(x, w, b, pro, epi))
                for cand in [incumbent, *cands]:
                    fn = lambda c=cand: G.gemm_fwd(x, w, b, prologue=pro, epilogue=epi, config=c)  # noqa: E731
                    try:
                        same = bool(torch.equal(fn()[0], base))
                        ms = _bench_graph(fn)
                    except Exception as exc:  # a candidate that does not compile/run is recorded, not fatal
                        report["errors"].append(f"text {name} M={m} {cand}: {type(exc).__name__}: {str(exc)[:300]}")
                        continue
                    if ms is None:
                        report["errors"].append(f"text {name} M={m} {cand}: no CUDA-graph time (capture failed)")
                        continue
                    report["sweep"].append({
                        "layer": f"{name} (text)" if text or name == "txt_in" else name, "kind": "fwd",
                        "dtype": "bf16" if dt == torch.bfloat16 else "fp32", "M": m, "config": cand.as_dict(),
                        "ms": ms, "tflops": 2.0 * m * n * k / ms / 1e9, "graph_ms": ms,
                        "cublas_graph_ms": ref_ms, "ratio_graph": (ref_ms / ms) if ms and ref_ms else None,
                        "incumbent": cand == incumbent, "bytes_equal_incumbent": same})
        save()


def round2_sweep(G, C, report, save, budget_ok, classes=None, big_candidates=None):
    """Time candidates per (N, K, bf16) class, each passed explicitly (``config=`` / ``dx_config=``),
    and record the fastest (``report["round2_winners"]``; adopting one is an edit of configs.py and a
    qualification run). A class serving several uses
    (e.g. (12288, 3072): mlp_up fwd and mlp_down dX) is scored by the sum over its uses of
    time / incumbent time."""
    dt = torch.bfloat16
    uses = {}  # key -> list of (layer, kind, m, n, k, bias, pro, epi)
    big = {l[0]: l for l in LAYERS[:4]}
    for name, (nm, n, k, bias, pro, epi, _) in big.items():
        uses.setdefault((n, k, "bf16"), []).append((name, "fwd", 4224, n, k, bias, pro, epi))
        uses.setdefault((k, n, "bf16"), []).append((name, "dX", 4224, n, k, bias, pro, epi))
    for (nm, n, k, bias, pro, epi, _) in (LAYERS[4], LAYERS[5]):
        uses.setdefault((n, k, "bf16"), []).append((nm, "fwd", 8, n, k, bias, pro, epi))
        uses.setdefault((k, n, "bf16"), []).append((nm, "dX", 8, n, k, bias, pro, epi))
    data = {}

    def inputs(n, k, m, bias):
        w, b, _ = _weights(n, k, dt, bias, gen_seed=7)
        g = torch.Generator(device=DEVICE).manual_seed(8)
        return w, b, torch.randn(m, k, generator=g, device=DEVICE).to(dt), torch.randn(m, n, generator=g, device=DEVICE).to(dt)

    from triton.testing import do_bench

    winners = {}
    for key, us in uses.items():
        if classes is not None and f"{key[0]}x{key[1]}" not in classes:
            continue
        if not budget_ok():
            report["errors"].append(f"round2 sweep skipped (time budget) from {key}")
            break
        cands = ROUND2_MOD_DX if us[0][2] == 8 and us[0][1] == "dX" else ROUND2_MOD_FWD if us[0][2] == 8 else (big_candidates or ROUND2_BIG)
        incumbent = C.FWD.get(key)
        scores = []
        for ci, cand in enumerate(cands):
            rows, ok = [], True
            for (name, kind, m, n, k, bias, pro, epi) in us:
                if kind == "dX" and cand.weight_layout == "nk":
                    ok = False
                    break
                tag = (name, kind, m)
                if tag not in data:
                    data[tag] = inputs(n, k, m, bias)
                w, b, x, dz = data[tag]
                if kind == "fwd":
                    fn = lambda: G.gemm_fwd(x, w, b, prologue=pro, epilogue=epi, config=cand)  # noqa: E731
                    ref = lambda: _torch_linear(x, w, b, pro, epi)  # noqa: E731
                else:
                    fn = lambda: G.gemm_bwd(dz, x, w, seqlens=(m,), prologue=pro, needs=(True, False, False, False, False),  # noqa: E731
                                            dx_config=cand)
                    ref = (lambda: torch.mm(dz, w)) if pro == "none" else (lambda: torch.mm(dz, w) * torch.sigmoid(x))  # noqa: E731
                try:
                    with torch.no_grad():
                        t = do_bench(fn, warmup=10, rep=40, quantiles=[0.5])
                        t = t[0] if isinstance(t, (list, tuple)) else t
                        tr = do_bench(ref, warmup=10, rep=40, quantiles=[0.5])
                        tr = tr[0] if isinstance(tr, (list, tuple)) else tr
                except Exception as exc:  # a candidate that does not compile/run is recorded, not fatal
                    report["errors"].append(f"round2 {key} {cand}: {type(exc).__name__}: {str(exc)[:300]}")
                    ok = False
                    break
                with torch.no_grad():
                    stats = dict(zip(("n_regs", "n_spills"), kernel_stats(lambda hook: G.gemm_fwd(
                        x, w, b, prologue=pro, epilogue=epi, config=cand, on_launch=hook))[1])) if kind == "fwd" else {}
                    tg, tgr = _bench_graph(fn), _bench_graph(ref)
                rows.append({"layer": name, "kind": kind, "M": m, "ms": t, "cublas_ms": tr, "ratio": tr / t,
                             "graph_ms": tg, "cublas_graph_ms": tgr})
                report["sweep"].append({"layer": name, "kind": kind, "dtype": "bf16", "M": m, "config": cand.as_dict(), "ms": t,
                                        "tflops": 2.0 * m * n * k / t / 1e9, "cublas_ms": tr, "ratio": tr / t, "key": list(key),
                                        "graph_ms": tg, "cublas_graph_ms": tgr,
                                        "ratio_graph": (tgr / tg) if tg and tgr else None, **stats})
            if ok:
                scores.append((ci, rows))
        if scores:
            graph = all(r.get("graph_ms") for _, rs in scores for r in rs)
            tkey = "graph_ms" if graph else "ms"  # GPU time where every candidate could be captured
            base = {r["layer"] + r["kind"]: r[tkey] for r in scores[0][1]} if scores[0][0] == 0 else None

            def score(entry):
                return sum(r[tkey] / (base[r["layer"] + r["kind"]] if base else 1.0) for r in entry[1])
            best_ci, best_rows = min(scores, key=score)
            winners[str(key)] = {"config": cands[best_ci].as_dict(), "rows": best_rows,
                                 "incumbent": incumbent.as_dict() if incumbent else None}
        report["round2_winners"] = winners
        save()
        print(f"round2 {key}: {winners.get(str(key), {}).get('config')}", flush=True)
    # epilogue cost of mlp_up under its winning (else committed) config: gelu vs none
    if budget_ok() and ("mlp_up", "fwd", 4224) in data:
        w, b, x, _ = data[("mlp_up", "fwd", 4224)]
        won = winners.get(str((12288, 3072, "bf16")))
        best = FwdConfig(**won["config"]) if won else C.FWD[(12288, 3072, "bf16")]
        with torch.no_grad():
            for epi in ("none", "gelu_tanh"):
                fn = lambda: G.gemm_fwd(x, w, b, epilogue=epi, config=best)  # noqa: E731
                t = do_bench(fn, warmup=10, rep=60, quantiles=[0.5])
                report.setdefault("epilogue_cost", []).append({"layer": "mlp_up", "epilogue": epi, "ms": t[0] if isinstance(t, (list, tuple)) else t,
                                                               "graph_ms": _bench_graph(fn)})
            for label, fn in (("cublas addmm", lambda: torch.addmm(b, x, w.t())),
                              ("cublas addmm + eager gelu", lambda: _torch_linear(x, w, b, "none", "gelu_tanh"))):
                report["epilogue_cost"].append({"layer": "mlp_up", "epilogue": label, "graph_ms": _bench_graph(fn)})
        save()
    data.clear()


def sweep_case(G, C, name, n, k, bias, epilogue, dtype, m=4224, candidates=None, prologue="none"):
    """Time candidate configurations of one shape class (forward, and dX with the transposed class)."""
    w, b, _ = _weights(n, k, dtype, bias, gen_seed=7)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    dz = torch.randn(m, n, device=DEVICE).to(dtype)
    dt = C.dtype_name(dtype)
    out = []
    for kind in ("fwd", "dX"):
        for cand in candidates or SWEEP:
            if kind == "dX" and cand.weight_layout == "nk":
                continue
            with torch.no_grad():
                fn = (lambda c=cand: G.gemm_fwd(x, w, b, prologue=prologue, epilogue=epilogue, config=c)) if kind == "fwd" else (
                    lambda c=cand: G.gemm_bwd(dz, x, w, seqlens=(m,), prologue=prologue, needs=(True, False, False, False, False),
                                              dx_config=c))
                t = _bench(fn)["median_ms"]
            out.append({"layer": name, "kind": kind, "dtype": dt, "M": m, "config": cand.as_dict(), "ms": t,
                        "tflops": 2.0 * m * n * k / t / 1e9})
    return out


def _bytes_note(row: dict) -> str:
    """The text sweep's byte comparison with the class's incumbent configuration, for the config cell."""
    if "bytes_equal_incumbent" not in row:
        return ""
    if row.get("incumbent"):
        return " (incumbent)"
    return " (bytes = incumbent)" if row["bytes_equal_incumbent"] else " (new bytes)"


def _md(report: dict) -> str:
    e = report["env"]
    lines = ["# Strict GEMM engine — configuration sweeps", "", environment_line(e, f"TF32 {e.get('tf32')}"), ""]
    sw = report.get("sweep", [])
    if sw:
        lines += ["## Configuration sweep (informational)", "",
                  "| layer | kind | dtype | M | config | ms | TFLOP/s | graph ms (cuBLAS, ratio) | regs / spills |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for s in sw:
            extra = f" (cuBLAS {s['cublas_ms']:.4f}, ratio {s['ratio']:.2f})" if "ratio" in s else ""
            graph = (f"{s['graph_ms']:.4f} ({s['cublas_graph_ms']:.4f}, {s['ratio_graph']:.2f})"
                     if s.get("ratio_graph") else "—")
            regs = f"{s.get('n_regs')} / {s.get('n_spills')}" if s.get("n_regs") is not None else "—"
            lines.append(f"| {s['layer']} | {s['kind']} | {s['dtype']} | {s.get('M', 4224)} | {_cfg_str(s['config'])}{_bytes_note(s)} | "
                         f"{s['ms']:.4f}{extra} | {s['tflops']:.1f} | {graph} | {regs} |")
        lines.append("")
    win = report.get("round2_winners")
    if win:
        lines += ["## Sweep winners (fastest candidate per class, not adopted)", "",
                  "| key (N, K, dtype) | config | uses: ms (cuBLAS ms, ratio) |", "|---|---|---|"]
        for key, v in win.items():
            us = "; ".join(f"{r['layer']} {r['kind']} M={r['M']}: {r['ms']:.4f} ({r['cublas_ms']:.4f}, {r['ratio']:.2f})"
                           + (f", graph {r['graph_ms']:.4f} ({r['cublas_graph_ms']:.4f})" if r.get("graph_ms") and r.get("cublas_graph_ms") else "")
                           for r in v["rows"])
            lines.append(f"| {key} | {_cfg_str(v['config'])} | {us} |")
        lines.append("")
    if report.get("epilogue_cost"):
        def _ms(v):
            return f"{v:.4f} ms" if v is not None else "—"

        lines += ["## mlp_up epilogue cost (adopted config, M = 4224)", ""] + [
            f"- {e['epilogue']}: do_bench {_ms(e.get('ms'))}, graph {_ms(e.get('graph_ms'))}" for e in report["epilogue_cost"]] + [""]
    return "\n".join(lines + md_footer(report)) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sweep", choices=("big", "small", "round2", "round3", "round5", "text", "vector"), default="big")
    ap.add_argument("--classes", default=None, help="round2/3/5: comma list of NxK classes to sweep (default: all)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop sweeping past this wall time")
    args = ap.parse_args(argv)
    cuda_setup("the GEMM sweeps")
    from mmdit_strict.kernels.triton import configs as C
    from mmdit_strict.kernels.triton import gemm as G

    report = {"env": _env(), "sweep": [], "errors": []}
    run = ReportWriter(args.out, "sweeps", report, _md, args.budget_s)
    save, guarded = run.save, run.guarded
    if args.sweep.startswith("round"):
        classes = set(args.classes.split(",")) if args.classes else None
        guarded(f"{args.sweep} sweep", lambda: round2_sweep(
            G, C, report, save, run.budget_ok, classes=classes,
            big_candidates={"round3": ROUND3_BIG, "round5": ROUND5_BIG}.get(args.sweep)))
    elif args.sweep == "text":
        guarded("text sweep", lambda: text_sweep(G, C, report, save, run.budget_ok))
    elif args.sweep == "vector":
        guarded("vector sweep", lambda: text_sweep(G, C, report, save, run.budget_ok, cases=VECTOR_CASES))
    elif args.sweep == "big":
        for (name, n, k, bias, _pro, epi, _) in LAYERS[:4]:
            report["sweep"] += guarded(f"sweep {name}", lambda: sweep_case(G, C, name, n, k, bias, epi, torch.bfloat16))
            save()
    else:
        for (name, n, k, bias, pro, epi, _) in (LAYERS[4], LAYERS[8]):
            m = 8 if pro == "silu" else 4224
            report["sweep"] += guarded(f"sweep {name}", lambda: sweep_case(
                G, C, name, n, k, bias, epi, torch.bfloat16, m=m, candidates=SWEEP_SMALL, prologue=pro))
            save()
    return run.finish()


if __name__ == "__main__":
    raise SystemExit(main())

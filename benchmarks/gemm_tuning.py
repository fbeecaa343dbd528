"""Tuning probes for the strict GEMM engine on a CUDA GPU (informational; the qualification is
``mmdit-strict qualify --section gemm``).

    python -m benchmarks.gemm_tuning --out DIR [--what dw,fp32,host]      (from the repository root)

* ``dw``: weight-gradient tile candidates (``configs.DW`` entries) for the four M = 4224 layers, BF16,
  one sample of 4224 rows, against ``torch.mm(dZᵀ, x)``;
* ``fp32``: forward tile candidates for the FP32 (IEEE FMA) size class, attn_out and mlp_up shapes,
  against cuBLAS with TF32 off;
* ``host``: the host-side cost of one small-M call (the modulation projections at M = 1 and 8):
  microseconds per call when launches are not waited on, and the profile's top functions.

Every timing is a ``do_bench`` median and a CUDA-graph replay median (GPU time only). Each candidate
is passed to the engine explicitly (``gemm_dw(config=...)``, ``gemm_fwd(config=...)``); ``configs`` is
never edited. Candidates only change tiles, never the reduction order's dependence on M, so each is
as batch-invariant as the incumbent; adopting one is an edit of configs.py and a qualification run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from mmdit_strict.bench import timing
from mmdit_strict.environment import environment_line
from mmdit_strict.bench.gemm import (
    ReportWriter,
    _bench,
    _bench_graph,
    _env,
    _torch_linear,
    _weights,
    cuda_setup,
    md_footer,
)
from mmdit_strict.kernels.triton.configs import DwConfig, FwdConfig

# the probes' shapes as they ran (qkv: the concatenated 9216-wide product; the model runs three 3072-wide ones)
BIG = [("qkv", 9216, 3072), ("attn_out", 3072, 3072), ("mlp_up", 12288, 3072), ("mlp_down", 3072, 12288)]


DW_CANDIDATES = [
    DwConfig(128, 128, 64, 8, 3), DwConfig(128, 128, 64, 8, 4), DwConfig(128, 256, 64, 8, 3), DwConfig(256, 128, 64, 8, 3),
    DwConfig(128, 256, 32, 8, 4), DwConfig(128, 128, 128, 8, 2), DwConfig(128, 256, 64, 8, 4), DwConfig(128, 128, 64, 4, 3),
]

FP32_CANDIDATES = [
    FwdConfig(128, 128, 32, 8, 3), FwdConfig(128, 128, 16, 8, 4), FwdConfig(128, 128, 32, 4, 3), FwdConfig(64, 128, 32, 4, 3),
    FwdConfig(128, 64, 32, 4, 3), FwdConfig(256, 128, 16, 8, 3), FwdConfig(128, 256, 16, 8, 3), FwdConfig(64, 64, 32, 4, 4),
]


def _time(fn) -> dict:
    with torch.no_grad():
        return {"ms": _bench(fn)["median_ms"], "graph_ms": _bench_graph(fn)}


def _try_candidates(candidates: list, fn, ref: dict, tag: str, meta: dict) -> list[dict]:
    """Time ``fn(candidate)`` for each candidate configuration (passed to the engine explicitly)."""
    rows = []
    for cand in candidates:
        try:
            t = _time(lambda c=cand: fn(c))
        except Exception as exc:  # a candidate that does not fit is recorded, not fatal
            rows.append({**meta, "config": cand.as_dict(), "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            continue
        rows.append({**meta, "config": cand.as_dict(), **t, "cublas_ms": ref["ms"], "cublas_graph_ms": ref["graph_ms"],
                     "ratio_graph": ref["graph_ms"] / t["graph_ms"] if t["graph_ms"] and ref["graph_ms"] else None})
        print(f"{tag} {meta['layer']} {cand}: {t['graph_ms']} (cuBLAS {ref['graph_ms']})", flush=True)
    return rows


def dw_probe(G, m: int = 4224) -> list[dict]:
    rows = []
    for name, n, k in BIG:
        g = torch.Generator(device="cuda").manual_seed(11)
        dz = torch.randn(m, n, generator=g, device="cuda").to(torch.bfloat16)
        x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
        ref = _time(lambda: torch.mm(dz.t(), x))
        rows += _try_candidates(DW_CANDIDATES, lambda c: G.gemm_dw(dz, x, (m,), config=c), ref, "dw",
                                {"layer": name, "N": n, "K": k})
    return rows


def fp32_probe(G, m: int = 4224) -> list[dict]:
    rows = []
    for name, n, k, epi in (("attn_out", 3072, 3072, "none"), ("mlp_up", 12288, 3072, "gelu_tanh")):
        w, b, _ = _weights(n, k, torch.float32, True, gen_seed=5)
        x = torch.randn(m, k, generator=torch.Generator(device="cuda").manual_seed(6), device="cuda")
        ref = _time(lambda: _torch_linear(x, w, b, "none", epi))
        rows += _try_candidates(FP32_CANDIDATES, lambda c: G.gemm_fwd(x, w, b, epilogue=epi, config=c), ref,
                                "fp32", {"layer": name, "N": n, "K": k})
    return rows


def host_probe(G, calls: int = 300) -> list[dict]:
    rows = []
    for name, n, k, m in (("final_mod", 6144, 3072, 1), ("mod", 18432, 3072, 8)):
        w, b, _ = _weights(n, k, torch.bfloat16, True, gen_seed=3)
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        for label, fn in (("gemm (checks + launches)", lambda: G.gemm(x, w, b, seqlens=(1,) * m, prologue="silu")),
                          ("gemm_fwd (launches)", lambda: G.gemm_fwd(x, w, b, prologue="silu")),
                          ("cuBLAS F.linear(silu(x))", lambda: _torch_linear(x, w, b, "silu", "none"))):
            with torch.no_grad():
                host_us = timing.host_us(fn, calls, warmup=20)
            rows.append({"layer": name, "M": m, "what": label, "host_us_per_call": host_us})
            print(f"host {name} M={m} {label}: {host_us:.1f} us/call", flush=True)
        prof = cProfile.Profile()
        with torch.no_grad():
            prof.enable()
            for _ in range(calls):
                G.gemm(x, w, b, seqlens=(1,) * m, prologue="silu")
            prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        rows.append({"layer": name, "M": m, "what": "profile (tottime, gemm)", "profile": s.getvalue()})
    return rows


def _md(report: dict) -> str:
    e = report["env"]
    lines = ["# Strict GEMM engine — tuning probes", "",
             environment_line(e), ""]

    def cfg(c):
        return " ".join(f"{k}={v}" for k, v in c.items() if k not in ("weight_layout", "prologue", "tma"))

    for section, title in (("dw", "dW tiles (BF16, one 4224-row sample)"), ("fp32", "FP32 forward tiles (M = 4224)")):
        if report.get(section):
            lines += [f"## {title}", "", "| layer | config | ms | graph ms | cuBLAS graph ms | graph ratio |", "|---|---|---|---|---|---|"]
            for r in report[section]:
                if "error" in r:
                    lines.append(f"| {r['layer']} | {cfg(r['config'])} | error: {r['error']} | | | |")
                    continue
                gr = f"{r['ratio_graph']:.2f}" if r.get("ratio_graph") else "—"
                gms = f"{r['graph_ms']:.4f}" if r.get("graph_ms") else "—"
                cgms = f"{r['cublas_graph_ms']:.4f}" if r.get("cublas_graph_ms") else "—"
                lines.append(f"| {r['layer']} | {cfg(r['config'])} | {r['ms']:.4f} | {gms} | {cgms} | {gr} |")
            lines.append("")
    if report.get("host"):
        lines += ["## Host cost of one small-M call (no waiting on the GPU)", ""]
        for r in report["host"]:
            if "profile" in r:
                lines += [f"Profile, {r['layer']} M={r['M']}:", "", "```", r["profile"].strip(), "```", ""]
            else:
                lines.append(f"- {r['layer']} M={r['M']} {r['what']}: {r['host_us_per_call']:.1f} µs/call")
        lines.append("")
    return "\n".join(lines + md_footer(report)) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output folder (tuning.json, tuning.md)")
    ap.add_argument("--what", default="dw,fp32,host", help="comma list of dw, fp32, host")
    args = ap.parse_args(argv)
    cuda_setup("the GEMM tuning probes")
    from mmdit_strict.kernels.triton import gemm as G

    report: dict = {"env": _env()}
    run = ReportWriter(args.out, "tuning", report, _md)
    probes = {"dw": lambda: dw_probe(G), "fp32": lambda: fp32_probe(G), "host": lambda: host_probe(G)}
    for what in args.what.split(","):
        report[what] = run.guarded(what, probes[what])
        run.save()
    return run.finish()


if __name__ == "__main__":
    raise SystemExit(main())

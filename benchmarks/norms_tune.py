"""Launch candidates of the row kernels, timed on the GPU: LayerNorm modulation forward / backward, QK norm / RoPE
forward and backward, txt_in's one-head RMSNorm.

    python -m benchmarks.norms_tune --out DIR [--kinds ln,qk,...] [--budget-s 600]

Writes ``DIR/norms_tune.json`` and ``DIR/norms_tune.md``: per kernel family and case, every candidate of
``benchmarks/row_launches.py`` (passed as the launcher's ``config=``), its kernel time (CUDA-graph replay), GB/s and
fraction of the same-size copy, and whether its outputs equal the reference launch's bytes (they must: no launch
setting changes the arithmetic). The product path is not touched.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from mmdit_strict.bench import markdown as md
from mmdit_strict.environment import environment_line
from mmdit_strict.bench.norms import (CT, D, DEVICE, DTYPES, EPS, HEAD_DIM, HEADS, _env, _f, _graph_ms, _randn, _tables,
                                      copy_gbps)


def _bytes_equal(got, want) -> bool:
    return all(a is None and b is None or (a is not None and b is not None and a.dtype == b.dtype and a.shape == b.shape
                                            and torch.equal(a, b)) for a, b in zip(got, want))


def tune_case(kind: str, dname: str, rows: int, seed: int) -> list[dict]:
    """Every launch candidate of one kernel family on one single-sample case: kernel time (CUDA-graph replay),
    GB/s and fraction of the same-size copy, and whether its outputs equal the reference launch's bytes.

    kind: "ln" (adaln_modulation's forward — no statistics stored, as under no_grad — and backward),
    "qk" / "qk_rope" (the QK norm backward without / with the rotation, 24 × 128), "txt" (one head of 3584);
    "qk_fwd" / "qk_rope_fwd" / "txt_fwd" the QK forward kernel's launches (norm, fused norm + RoPE, txt_in's norm)."""
    from mmdit_strict.kernels.triton import norms as N
    from mmdit_strict.kernels.triton import rope as R

    from benchmarks.row_launches import LN_CANDIDATES, LN_REFERENCE, QK_BWD_CANDIDATES, QK_BWD_REFERENCE, QK_FWD_CANDIDATES, QK_FWD_REFERENCE

    dt = DTYPES[dname]
    es = torch.empty((), dtype=dt).element_size()
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    seq = (rows,)
    out: list[dict] = []

    def record(kernel, launch, ms, nbytes, equal, ref):
        row = {"kernel": kernel, "dtype": dname, "rows": rows, "launch": launch.label(), "reference": launch == ref,
               "ms": ms, "bytes": nbytes, "equal_reference": bool(equal)}
        if ms:
            row["gbps"] = nbytes / (ms * 1e-3) / 1e9
            row["copy_gbps"] = copy_gbps(nbytes)
            row["fraction"] = row["gbps"] / row["copy_gbps"]
        out.append(row)

    if kind == "ln":
        x, gy = _randn((rows, D), g, dt), _randn((rows, D), g, dt)
        sh, sc = _randn((1, D), g, dt, 0.5), _randn((1, D), g, dt, 0.5)
        want_f = N.adaln_modulation_fwd(x, sh, sc, seq, EPS, True, config=LN_REFERENCE)
        want_b = N.adaln_modulation_bwd(gy, x, sc, want_f[1], want_f[2], seq, True, config=LN_REFERENCE)
        for c in LN_CANDIDATES:
            got_f = N.adaln_modulation_fwd(x, sh, sc, seq, EPS, True, config=c)
            got_b = N.adaln_modulation_bwd(gy, x, sc, want_f[1], want_f[2], seq, True, config=c)
            ms_f = _graph_ms(lambda: N.adaln_modulation_fwd(x, sh, sc, seq, EPS, False, config=c), rep=30)
            ms_b = _graph_ms(lambda: N.adaln_modulation_bwd(gy, x, sc, want_f[1], want_f[2], seq, True, config=c), rep=30)
            record("adaln_modulation fwd", c, ms_f, 2 * rows * D * es, _bytes_equal(got_f, want_f), LN_REFERENCE)
            record("adaln_modulation bwd", c, ms_b, 3 * rows * D * es, _bytes_equal(got_b, want_b), LN_REFERENCE)
        return out
    h, d = (1, CT) if kind.startswith("txt") else (HEADS, HEAD_DIM)
    x, gy = _randn((rows, h, d), g, dt), _randn((rows, h, d), g, dt)
    gain = (1 + _randn((d,), g, torch.float32, 0.1)).to(dt)
    c, s = _tables(rows, g) if kind.startswith("qk_rope") else (None, None)
    if kind.endswith("_fwd"):
        name = {"qk_fwd": "qk_rmsnorm fwd", "qk_rope_fwd": "qk_rmsnorm_rope (fused) fwd",
                "txt_fwd": "txt_in rmsnorm fwd (1 x 3584)"}[kind]

        def fwd(launch, rstd):
            return R._contig_fwd(x, gain, c, s, EPS, rstd, 1.0, config=launch)

        want_r = torch.empty((rows, h), dtype=torch.float32, device=DEVICE)
        want = (fwd(QK_FWD_REFERENCE, want_r), want_r)
        for cand in QK_FWD_CANDIDATES:
            got_r = torch.empty_like(want_r)
            got = (fwd(cand, got_r), got_r)
            ms = _graph_ms(lambda: fwd(cand, None), rep=30)  # no rstd stored: the no-grad forward
            record(name, cand, ms, 2 * rows * h * d * es, _bytes_equal(got, want), QK_FWD_REFERENCE)
        return out
    _, rstd = R.qk_norm_fwd(x, gain, c, s, EPS, store_rstd=True)
    want = R.qk_norm_bwd(gy, x, gain, rstd, c, s, seq, True, config=QK_BWD_REFERENCE)
    name = {"qk": "qk_rmsnorm bwd", "qk_rope": "qk_rmsnorm_rope (fused) bwd", "txt": "txt_in rmsnorm bwd (1 x 3584)"}[kind]
    for cand in QK_BWD_CANDIDATES:
        got = R.qk_norm_bwd(gy, x, gain, rstd, c, s, seq, True, config=cand)
        ms = _graph_ms(lambda: R.qk_norm_bwd(gy, x, gain, rstd, c, s, seq, True, config=cand), rep=30)
        record(name, cand, ms, 3 * rows * h * d * es, _bytes_equal(got, want), QK_BWD_REFERENCE)
    return out


TUNE_CASES = (("qk_rope_fwd", "bf16", 4096), ("qk_rope_fwd", "bf16", 6889), ("qk_rope_fwd", "fp32", 4096),
              ("qk_fwd", "bf16", 4096), ("txt_fwd", "bf16", 256), ("txt_fwd", "fp32", 256),
              ("ln", "bf16", 4096), ("ln", "bf16", 6889), ("ln", "fp32", 4096),
              ("qk", "bf16", 4096), ("qk", "bf16", 6889), ("qk", "fp32", 4096),
              ("qk_rope", "bf16", 4096), ("qk_rope", "bf16", 6889), ("qk_rope", "fp32", 4096),
              ("txt", "bf16", 256), ("txt", "fp32", 256))


def _tune_row(t: dict) -> str:
    return md.row(t["kernel"], t["dtype"], t["rows"], t["launch"] + (" (reference)" if t["reference"] else ""),
                  _f(t.get("ms"), ".4f"),
                  f"{t['gbps']:.0f} ({t['copy_gbps']:.0f}, {t['fraction']:.2f})" if "gbps" in t else "—",
                  "yes" if t["equal_reference"] else "NO")


def render(report: dict) -> str:
    """The markdown report: the launch-candidate table."""
    lines = ["# Row kernels — launch candidates", "", environment_line(report["env"]), ""]
    lines += md.rows_section(
        report.get("tune"),
        lambda tu: f"Launch candidates ({sum(t['equal_reference'] for t in tu)}/{len(tu)} byte-equal to the reference launch)",
        ("kernel", "dtype", "rows", "launch", "ms", "GB/s (copy, fraction)", "bytes = reference"),
        _tune_row,
        ["The kernel alone, B = 1, CUDA-graph replay (median of 30 ms of replays); the reference launch is "
         "benchmarks/row_launches.py's. `bytes = reference`: every output of the launch on that case equals the "
         "reference launch's, `torch.equal`."])
    return "\n".join(lines + md.errors_and_wall_time(report)) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kinds", default=None,
                    help=f"comma list of kernel families (default: all of {', '.join(dict.fromkeys(k for k, _, _ in TUNE_CASES))})")
    ap.add_argument("--budget-s", type=float, default=600.0, help="skip remaining cases past this wall time")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the launch-candidate timing needs a CUDA device")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    report: dict[str, Any] = {"env": _env(), "tune": [], "errors": []}
    for kind, dname, rows in TUNE_CASES:
        if args.kinds and kind not in args.kinds.split(","):
            continue
        if time.time() - t0 > args.budget_s:
            report["errors"].append(f"tune {kind} {dname} {rows}: skipped (wall-time budget {args.budget_s:.0f} s)")
            continue
        try:
            report["tune"] += tune_case(kind, dname, rows, 50)
        except Exception as exc:  # noqa: BLE001 - record and continue
            report["errors"].append(f"tune {kind} {dname} {rows}: {type(exc).__name__}: {exc}")
        torch.cuda.empty_cache()
        report["wall_s"] = time.time() - t0
        (out_dir / "norms_tune.json").write_text(json.dumps(report, indent=1))
        (out_dir / "norms_tune.md").write_text(render(report))
    return 0 if all(t["equal_reference"] for t in report["tune"]) and not report["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

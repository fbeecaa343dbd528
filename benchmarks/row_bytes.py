"""Byte snapshot of the LayerNorm-family row operators, to check that a refactor of their kernels keeps every byte.

A snapshot runs ``adaln_modulation`` (forward: y, mean, rstd; backward: dx, d_shift, d_scale) and
``adaln_gate_residual`` (forward; backward: dy, d_gate) on fixed-seed inputs at D = 3072 (the thirds kernels) and
D = 40 (the one-tile kernels), in bf16 and fp32, one sample of 4096 rows and a packed batch (77, 0, 300, 16)
rows, with the default launches, and saves every tensor to one safetensors file. Two snapshots, one made with
the code before a change and one after, are compared tensor by tensor on their raw bytes (``torch.equal`` of the
uint8 views); the exit status is 1 when any tensor differs or is missing.

    python -m benchmarks.row_bytes snap OUT.safetensors          # with the code on sys.path
    python -m benchmarks.row_bytes compare BEFORE.safetensors AFTER.safetensors [--md OUT.md]

The inputs come from a CPU generator, so they do not depend on the device's generator; the snapshot is made on
CUDA when it is present, else in the Triton interpreter (FP32 only, small shapes).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

EPS = 1e-6


def _cases(gpu: bool) -> list[tuple[str, torch.dtype, int, tuple[int, ...]]]:
    dtypes = (torch.bfloat16, torch.float32) if gpu else (torch.float32,)
    shapes = ((3072, (4096,)), (3072, (77, 0, 300, 16)), (40, (77, 0, 300, 16))) if gpu else \
        ((48, (20,)), (48, (5, 0, 19, 3)), (40, (5, 0, 19, 3)))
    return [(f"{str(dt).removeprefix('torch.')}_d{d}_{'-'.join(map(str, seq))}", dt, d, seq)
            for dt in dtypes for d, seq in shapes]


def snapshot(device: str) -> dict[str, torch.Tensor]:
    """Every output and gradient of the two operators for :func:`_cases` (tensors moved to the CPU)."""
    from mmdit_strict.kernels.triton import norms as N

    out: dict[str, torch.Tensor] = {}
    for name, dt, d, seq in _cases(device == "cuda"):
        g = torch.Generator().manual_seed(1234 + d + len(seq))
        m, b = sum(seq), len(seq)

        def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(dt).to(device)

        x, dy, y2 = rnd(m, d), rnd(m, d), rnd(m, d)
        shift, scale, gate = rnd(b, d, scale=0.1), rnd(b, d, scale=0.1), rnd(b, d, scale=0.5)
        y, mean, rstd = N.adaln_modulation_fwd(x, shift, scale, seq, EPS, store_stats=True)
        dx, d_shift, d_scale = N.adaln_modulation_bwd(dy, x, scale, mean, rstd, seq, need_vec=True)
        res = N.gate_residual_fwd(x, y2, gate, seq)
        g_dy, g_dgate = N.gate_residual_bwd(dy, y2, gate, seq, need_dy=True, need_gate=True)
        for key, t in (("ln_y", y), ("ln_mean", mean), ("ln_rstd", rstd), ("ln_dx", dx), ("ln_dshift", d_shift),
                       ("ln_dscale", d_scale), ("gate_out", res), ("gate_dy", g_dy), ("gate_dgate", g_dgate)):
            out[f"{name}.{key}"] = t.detach().cpu().contiguous()
    return out


def compare(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    """(name, 'equal' | 'DIFFERENT (n of N bytes)' | 'missing ...') per tensor of either snapshot."""
    rows = []
    for key in sorted(set(before) | set(after)):
        if key not in before or key not in after:
            rows.append((key, "missing before" if key not in before else "missing after"))
            continue
        a, b = before[key], after[key]
        if a.dtype != b.dtype or a.shape != b.shape:
            rows.append((key, f"DIFFERENT ({a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)})"))
            continue
        ua, ub = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        rows.append((key, "equal" if torch.equal(ua, ub) else f"DIFFERENT ({int((ua != ub).sum())} of {ua.numel()} bytes)"))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snap", help="write a snapshot of the current code's bytes")
    s.add_argument("out", type=Path)
    c = sub.add_parser("compare", help="compare two snapshots byte for byte (exit 1 on any difference)")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--md", type=Path, default=None, help="also write the table as markdown")
    args = ap.parse_args(argv)
    if args.cmd == "snap":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel modules are first imported (below)
        snap = snapshot(device)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        save_file(snap, str(args.out), metadata={"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"})
        print(f"{len(snap)} tensors -> {args.out}")
        return 0
    rows = compare(load_file(str(args.before)), load_file(str(args.after)))
    bad = [r for r in rows if r[1] != "equal"]
    table = ["| tensor | raw bytes |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows),
             "", f"{len(rows) - len(bad)}/{len(rows)} tensors equal"]
    print("\n".join(table))
    if args.md:
        args.md.write_text("\n".join(table) + "\n")
    return 1 if bad or not rows else 0


if __name__ == "__main__":
    sys.exit(main())

"""Offline sm_90 compile of the strict joint attention kernels: registers, spills and memory instructions.

    python -m benchmarks.attention_sass --triton DIR [--dtype bf16|fp32] [--override JSON ...] [--sass-dir OUT]

No GPU is needed. ``DIR`` is an unpacked Triton 3.6 wheel (the H200 image's version; ``pip download
triton==3.6.0 --no-deps`` and unzip it — never into the repository): its ``ptxas`` builds the cubin
and its ``cuobjdump`` reads the resource usage and the SASS. Each ``--override`` (a JSON object, as in
``python -m mmdit_strict.bench.attention --override-bf16``) updates the frozen d=128 configuration of
``--dtype`` (default bf16); with none, the frozen configuration alone is compiled. The launch shapes are
the bench's (24 heads × 128, 77 text + 6889 image tokens); the tile table is a dummy (the kernels read it
at run time only).

Per kernel and configuration one row: registers, stack bytes (spill space), shared memory (Triton's
``metadata.shared``; a kernel over the H200's 227 KiB per block is flagged: it compiles, but its first launch
raises OutOfResources, as the 3-stage ``pv_async`` forward did at 5656ade), and counts of the SASS
instructions that tell where time goes without a GPU: local stores/loads (spills), ``LDSM`` (shared →
registers, e.g. a tensor-core operand reloaded every iteration), ``HGMMA`` (wgmma), ``WARPGROUP``
(wgmma fences and waits), 128-bit global loads, cp.async and TMA copies. ``--sass-dir`` also writes
every SASS listing. Triton's internal compile entry points are version specific: this is written
against 3.6.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .sm90 import Sm90Compiler, count_ops, instructions, loop_bodies, use_wheel

COUNTED = ("STL", "LDL", "LDSM", "HGMMA", "WARPGROUP", "LDG.E.128", "LDGSTS", "UTMALDG", "MUFU.EX2", "BAR")


def _counts(sass: str) -> dict[str, int]:
    return count_ops([op for _, op, _ in instructions(sass)], COUNTED)


def _loop_bodies(sass: str) -> list[list[str]]:
    """Opcode lists of the innermost loops: instructions from a backward branch's target to the branch.

    Loops under 100 instructions (table walks, descriptor set-up) and over 1500 (a loop around whole
    inner loops) are left out: what remains are the per-tile bodies (each segment's full-tile loop).
    """
    return [b for b in loop_bodies(instructions(sass)) if 100 <= len(b) - 1 <= 1500]


def _compile_all(A, torch, triton_dir: Path, override: dict, sass_dir: Path | None, tag: str, dtype) -> list[dict]:
    """Run attention_fwd/attention_bwd with every kernel launch replaced by an sm_90 compile; one row per kernel."""
    compiler = Sm90Compiler(triton_dir)
    rows: list[dict] = []

    def recorder(name: str):
        def on_build(b, kwargs) -> None:
            if sass_dir is not None:
                sass_dir.mkdir(parents=True, exist_ok=True)
                (sass_dir / f"{tag}.{name}.sass").write_text(b.sass)
            tiles = tuple(kwargs.get(k) for k in ("BLOCK_M", "BLOCK_N") if k in kwargs)
            loops = _loop_bodies(b.sass)
            # the per-tile key loop: the one issuing the most wgmma (the ws forward's epilogue loops are longer)
            body = max(loops, key=lambda b: (sum(op.startswith("HGMMA") for op in b), len(b))) if loops else []
            rows.append({"config": tag, "kernel": name, "tiles": tiles, "regs": b.regs, "stack": b.stack,
                         "smem": int(b.kernel.metadata.shared),
                         **_counts(b.sass), "loop": {"instructions": len(body), **count_ops(body, COUNTED)}})

        return on_build

    from mmdit_strict.kernels.triton import attention_bwd_ws as BW
    from mmdit_strict.kernels.triton import attention_ws as W

    saved = {}
    for name in ("_attn_fwd_kernel", "_bwd_delta_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"):
        saved[name] = getattr(A, name)
        setattr(A, name, compiler.wrap(saved[name], recorder(name)))
    ws_kernel = W._attn_fwd_ws_kernel
    W._attn_fwd_ws_kernel = compiler.wrap(ws_kernel, recorder("_attn_fwd_ws_kernel"))
    bws_kernel = BW._attn_bwd_dkdv_ws_kernel
    BW._attn_bwd_dkdv_ws_kernel = compiler.wrap(bws_kernel, recorder("_attn_bwd_dkdv_ws_kernel"))
    capability = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: (9, 0)  # the CPU tensors stand for the H200's
    patched = {"interpreting": lambda: False, "_ensure_allocator": lambda: None,
               "_tile_table": lambda tseq, iseq, block, device, *rest: (torch.zeros(4, 9, dtype=torch.int32), 4)}
    saved.update({k: getattr(A, k) for k in patched})
    for k, v in patched.items():
        setattr(A, k, v)
    try:
        heads, d, nt, ni, dt = 24, 128, 77, 6889, dtype
        cfg = A.config_for(d, dt).replace(**override)
        s = [torch.zeros(n, heads, d, dtype=dt) for n in (nt, nt, nt, ni, ni, ni)]
        lse = torch.zeros(nt + ni, heads)
        o = (torch.zeros_like(s[0]), torch.zeros_like(s[3]))
        A.attention_fwd(*s, (nt,), (ni,), cfg, out=(*o, lse))
        A.attention_bwd(*o, *s, *o, lse, (nt,), (ni,), cfg, out=tuple(torch.zeros_like(t) for t in s))
    finally:
        for k, v in saved.items():
            setattr(A, k, v)
        W._attn_fwd_ws_kernel = ws_kernel
        BW._attn_bwd_dkdv_ws_kernel = bws_kernel
        torch.cuda.get_device_capability = capability
    return rows


SMEM_LIMIT = 232448  # bytes of shared memory one block may use on the H200 (sm_90: 227 KiB)


def over(smem: int) -> str:
    """A flag for a kernel that would not launch on the H200 (Triton raises OutOfResources at the first launch)."""
    return " (over the 227 KiB limit)" if smem > SMEM_LIMIT else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--triton", required=True, help="an unpacked Triton 3.6 wheel (the directory holding triton/)")
    p.add_argument("--override", action="append", default=[], help="JSON object updating the frozen d=128 config of --dtype")
    p.add_argument("--sass-dir", default=None)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = p.parse_args(argv)
    triton_dir = use_wheel(args.triton)
    import torch
    import triton

    from mmdit_strict.bench.attention import _parse_override
    from mmdit_strict.kernels.triton import attention as A

    overrides = [("frozen", {})] + [(o, _parse_override(o, "--override")) for o in args.override]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    print(f"Triton {triton.__version__} from {triton_dir}, sm_90; {args.dtype} d=128, 24 heads, 77 + 6889 tokens")
    print("| config | kernel | (BM, BN) | regs | stack B | smem B | " + " | ".join(COUNTED) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(COUNTED))
    rows = []
    for n, (tag, override) in enumerate(overrides):
        label = "frozen" if not override else json.dumps(json.loads(tag), separators=(",", ":"))
        for r in _compile_all(A, torch, triton_dir, override, Path(args.sass_dir) if args.sass_dir else None, f"cfg{n}", dtype):
            rows.append((label, r))
            print(f"| {label} | {r['kernel']} | {r['tiles']} | {r['regs']} | {r['stack']} | {r['smem']}{over(r['smem'])} | "
                  + " | ".join(str(r[c]) for c in COUNTED) + " |")
    print("\nOne iteration of the per-tile loop with the most wgmma (the image segment's full tiles; the ws forward's\n"
          "loop holds both its masked and its full-tile branch):\n")
    print("| config | kernel | instructions | " + " | ".join(COUNTED) + " |")
    print("|---|---|---|" + "---|" * len(COUNTED))
    for label, r in rows:
        if r["loop"]["instructions"]:
            print(f"| {label} | {r['kernel']} | {r['loop']['instructions']} | " + " | ".join(str(r["loop"][c]) for c in COUNTED) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Offline sm_90 compile of the strict joint attention kernels: registers, spills and memory instructions.

    python -m benchmarks.attention_sass --triton DIR [--dtype bf16|fp32] [--override JSON ...] [--sass-dir OUT]

No GPU is needed. ``DIR`` is an unpacked Triton 3.6 wheel (the H200 image's version; ``pip download
triton==3.6.0 --no-deps`` and unzip it — never into the repository): its ``ptxas`` builds the cubin
and its ``cuobjdump`` reads the resource usage and the SASS. Each ``--override`` (a JSON object, as in
``python -m mmdit_strict.bench.attention --override-bf16``) updates the frozen d=128 configuration of
``--dtype`` (default bf16); with none, the frozen configuration alone is compiled. The launch shapes are
the bench's (24 heads × 128, 77 text + 6889 image tokens); the tile table is a dummy (the kernels read it
at run time only).

Per kernel and configuration one row: registers, stack bytes (spill space), and counts of the SASS
instructions that tell where time goes without a GPU: local stores/loads (spills), ``LDSM`` (shared →
registers, e.g. a tensor-core operand reloaded every iteration), ``HGMMA`` (wgmma), ``WARPGROUP``
(wgmma fences and waits), 128-bit global loads, cp.async and TMA copies. ``--sass-dir`` also writes
every SASS listing. Triton's internal compile entry points are version specific: this is written
against 3.6.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

COUNTED = ("STL", "LDL", "LDSM", "HGMMA", "WARPGROUP", "LDG.E.128", "LDGSTS", "UTMALDG", "MUFU.EX2", "BAR")


def _counts(sass: str) -> dict[str, int]:
    ops: collections.Counter = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            op = m.group(1)
            for name in COUNTED:
                if op == name or op.startswith(name + "."):
                    ops[name] += 1
    return {name: ops[name] for name in COUNTED}


def _loop_bodies(sass: str) -> list[list[str]]:
    """Opcode lists of the innermost loops: instructions from a backward branch's target to the branch.

    Loops under 100 instructions (table walks, descriptor set-up) and over 1500 (a loop around whole
    inner loops) are left out: what remains are the per-tile bodies (each segment's full-tile loop).
    """
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    index = {a: i for i, (a, _, _) in enumerate(ins)}
    bodies = []
    for i, (a, op, rest) in enumerate(ins):
        t = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        j = index.get(int(t.group(1), 16)) if t and int(t.group(1), 16) < a else None
        if j is not None and 100 <= i - j <= 1500:
            bodies.append([o for _, o, _ in ins[j:i + 1]])
    return bodies


def _compile_all(A, torch, triton_dir: Path, override: dict, sass_dir: Path | None, tag: str, dtype) -> list[dict]:
    """Run attention_fwd/attention_bwd with every kernel launch replaced by an sm_90 compile; one row per kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.compiler import compile as triton_compile
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    cuobjdump = str(triton_dir / "triton" / "backends" / "nvidia" / "bin" / "cuobjdump")
    rows: list[dict] = []

    class Compile:
        def __init__(self, fn, name: str) -> None:
            self.fn, self.name = fn, name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                backend = make_backend(target)
                binder = create_function_from_signature(self.fn.signature, self.fn.params, backend)
                bound, specialization, options = binder(*args, **kwargs)
                options, signature, constexprs, attrs = self.fn._pack_args(backend, kwargs, bound, specialization, options)
                kernel = triton_compile(ASTSource(self.fn, signature, constexprs, attrs), target=target,
                                        options=options.__dict__)
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(kernel.asm["cubin"])
                    f.flush()
                    res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
                    sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
                usage = dict(re.findall(r"(REG|STACK):(\d+)", res))
                if sass_dir is not None:
                    sass_dir.mkdir(parents=True, exist_ok=True)
                    (sass_dir / f"{tag}.{self.name}.sass").write_text(sass)
                tiles = tuple(kwargs.get(k) for k in ("BLOCK_M", "BLOCK_N") if k in kwargs)
                loops = _loop_bodies(sass)
                body = max(loops, key=len) if loops else []
                rows.append({"config": tag, "kernel": self.name, "tiles": tiles, "regs": int(usage.get("REG", -1)),
                             "stack": int(usage.get("STACK", -1)), **_counts(sass),
                             "loop": {"instructions": len(body), **_counts("\n".join(f"  /*0000*/ {o} ;" for o in body))}})

            return launch

    saved = {}
    for name in ("_attn_fwd_kernel", "_bwd_delta_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"):
        saved[name] = getattr(A, name)
        setattr(A, name, Compile(saved[name], name))
    patched = {"_interpreting": lambda: False, "_ensure_allocator": lambda: None,
               "_tile_table": lambda tseq, iseq, block, device: (torch.zeros(4, 9, dtype=torch.int32), 4)}
    saved.update({k: getattr(A, k) for k in patched})
    for k, v in patched.items():
        setattr(A, k, v)
    try:
        heads, d, nt, ni, dt = 24, 128, 77, 6889, dtype
        cfg = {**A.config_for(d, dt), **override}
        s = [torch.zeros(n, heads, d, dtype=dt) for n in (nt, nt, nt, ni, ni, ni)]
        lse = torch.zeros(nt + ni, heads)
        o = (torch.zeros_like(s[0]), torch.zeros_like(s[3]))
        A.attention_fwd(*s, (nt,), (ni,), cfg, out=(*o, lse))
        A.attention_bwd(*o, *s, *o, lse, (nt,), (ni,), cfg, out=tuple(torch.zeros_like(t) for t in s))
    finally:
        for k, v in saved.items():
            setattr(A, k, v)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--triton", required=True, help="an unpacked Triton 3.6 wheel (the directory holding triton/)")
    p.add_argument("--override", action="append", default=[], help="JSON object updating the frozen d=128 config of --dtype")
    p.add_argument("--sass-dir", default=None)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = p.parse_args(argv)
    triton_dir = Path(args.triton).resolve()
    if not (triton_dir / "triton" / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        raise ValueError(f"{triton_dir} holds no unpacked Triton wheel (triton/backends/nvidia/bin/cuobjdump missing)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError("unset TRITON_INTERPRET: the kernels must be built for the GPU compiler")
    if any(m == "triton" or m.startswith("triton.") for m in sys.modules):
        raise ValueError("triton was imported before --triton could be put first on sys.path")
    sys.path.insert(0, str(triton_dir))
    import torch
    import triton

    from mmdit_strict.bench.attention import _parse_override
    from mmdit_strict.kernels.triton import attention as A

    overrides = [("frozen", {})] + [(o, _parse_override(o, "--override")) for o in args.override]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    print(f"Triton {triton.__version__} from {triton_dir}, sm_90; {args.dtype} d=128, 24 heads, 77 + 6889 tokens")
    print("| config | kernel | (BM, BN) | regs | stack B | " + " | ".join(COUNTED) + " |")
    print("|---|---|---|---|---|" + "---|" * len(COUNTED))
    rows = []
    for n, (tag, override) in enumerate(overrides):
        label = "frozen" if not override else json.dumps(json.loads(tag), separators=(",", ":"))
        for r in _compile_all(A, torch, triton_dir, override, Path(args.sass_dir) if args.sass_dir else None, f"cfg{n}", dtype):
            rows.append((label, r))
            print(f"| {label} | {r['kernel']} | {r['tiles']} | {r['regs']} | {r['stack']} | "
                  + " | ".join(str(r[c]) for c in COUNTED) + " |")
    print("\nOne iteration of the longest per-tile loop (the image segment's full tiles):\n")
    print("| config | kernel | instructions | " + " | ".join(COUNTED) + " |")
    print("|---|---|---|" + "---|" * len(COUNTED))
    for label, r in rows:
        if r["loop"]["instructions"]:
            print(f"| {label} | {r['kernel']} | {r['loop']['instructions']} | " + " | ".join(str(r["loop"][c]) for c in COUNTED) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

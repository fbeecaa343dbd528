"""Offline sm_90 compile of the row operators' launch candidates: registers, spills, barriers per loop iteration.

    python -m benchmarks.rows_sass --triton DIR [--sass-dir OUT]

No GPU is needed. ``DIR`` is an unpacked Triton 3.6 wheel (the H200 image's version; ``pip download
triton==3.6.0 --no-deps`` and unzip it — never into the repository): its ``ptxas`` builds the cubin and
its ``cuobjdump`` reads the resource usage and the SASS. The real host functions run on CPU tensors of
the bench's shapes (24 heads × 128 and one head of 3584 for the QK norm backward, rows of 3072 for the
LayerNorm); each one's first kernel launch is compiled for sm_90 with the launch's own specialization
(alignment, divisibility, ``do_not_specialize``) and the host function is stopped there.

Per kernel one row: registers, stack bytes (spill space), local stores/loads, ``BAR`` (barriers), and
within the main loop (the longest backward branch's body) its instruction count, barriers, shuffles,
shared-memory stores/loads and global loads. Then, per ``tt.reduce`` of the kernel, its axis, number of
operands and the register layout of its operands (a sum's tree is that layout: two kernels whose dx sums
have the same layout reduce them in the same order). Triton's internal compile entry points are version
specific: this is written against 3.6.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from .sm90 import Sm90Compiler, count_ops, instructions, loop_bodies, use_wheel

COUNTED = ("STL", "LDL", "BAR", "SHFL", "STS", "LDS", "LDG")


class _Stop(Exception):
    """Raised by a patched launch once its kernel is compiled: the host function goes no further."""


def _instructions(sass: str) -> list[tuple[int, str, str]]:
    return instructions(sass)


def _counts(ops: list[str]) -> dict[str, int]:
    return count_ops(ops, COUNTED)


def _main_loop(ins: list[tuple[int, str, str]]) -> list[str]:
    """Opcodes of the longest loop: from a backward branch's target to the branch."""
    return max(loop_bodies(ins), key=len, default=[])


def _reduces(ttgir: str) -> list[tuple[int, int, str]]:
    """(axis, operands, operand layout) of every tt.reduce in the TTGIR."""
    layouts = {line.split(" = ")[0]: line.split(" = ", 1)[1].strip() for line in ttgir.splitlines() if line.startswith("#")}
    out = []
    for m in re.finditer(r'"tt\.reduce"\(([^)]*)\) <\{axis = (\d+) : i32\}>.*?\}\) : \(([^)]*)\)', ttgir, re.DOTALL):
        names = sorted(set(re.findall(r"tensor<[^>]*#(\w+)>", m.group(3))))
        lay = "; ".join(layouts.get("#" + n, n).replace("#ttg.blocked<", "blocked<") for n in names)
        out.append((int(m.group(2)), m.group(1).count("%"), lay))
    return out


def _compiler(triton_dir: Path, sass_dir: Path | None, rows: list[dict]):
    compiler = Sm90Compiler(triton_dir)

    def wrap(fn, label: str):
        def on_build(b, _kwargs) -> None:
            if sass_dir is not None:
                sass_dir.mkdir(parents=True, exist_ok=True)
                (sass_dir / f"{label}.sass").write_text(b.sass)
                (sass_dir / f"{label}.ttgir").write_text(b.kernel.asm["ttgir"])
            ins = _instructions(b.sass)
            loop = _main_loop(ins)
            rows.append({"label": label, "kernel": fn.__name__, "warps": b.num_warps, "regs": b.regs, "stack": b.stack,
                         "shared": int(b.kernel.metadata.shared),
                         "all": _counts([o for _, o, _ in ins]), "loop_len": len(loop), "loop": _counts(loop),
                         "reduces": _reduces(b.kernel.asm["ttgir"])})
            raise _Stop

        return compiler.wrap(fn, on_build)

    return wrap


def _setting(ahead: int, maxnreg: int | None, stages: int | None) -> str:
    return f"ahead {ahead}, maxnreg {maxnreg or '-'}" + (f", stages {stages}" if stages else "")


def _cases(torch, R, N):
    """(label, module, kernel attribute, host call) for every launch candidate at the bench's shapes."""
    def qk(h, d, dt, rope, launch):
        x = torch.zeros(64, h, d, dtype=dt)
        gain, rstd = torch.ones(d, dtype=dt), torch.zeros(64, h)
        cs = torch.zeros(64, d // 2) if rope else None
        return lambda: R.qk_norm_bwd(x, x, gain, rstd, cs, cs, (64,), True, config=launch)

    def ln(dt, fwd, launch):
        x, v, st = torch.zeros(64, 3072, dtype=dt), torch.zeros(1, 3072, dtype=dt), torch.zeros(64)
        if fwd:
            return lambda: N.adaln_modulation_fwd(x, v, v, (64,), 1e-6, True, config=launch)
        return lambda: N.adaln_modulation_bwd(x, x, v, st, st, (64,), True, config=launch)

    def qk_fwd(h, d, dt, rope, launch):
        x = torch.zeros(64, h, d, dtype=dt)
        gain, rstd = torch.ones(d, dtype=dt), torch.zeros(64, h)
        cs = torch.zeros(64, d // 2) if rope else None
        return lambda: R._contig_fwd(x, gain, cs, cs, 1e-6, rstd, 1.0, config=launch)

    cases = []
    for dn, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for launch in L.QK_FWD_CANDIDATES:
            cases.append((f"qk_fwd 24x128 [{launch.label()}] {dn}", R, "_qk_fwd_kernel", qk_fwd(24, 128, dt, True, launch)))
            cases.append((f"qk_fwd 1x3584 (txt_in) [{launch.label()}] {dn}", R, "_qk_fwd_kernel", qk_fwd(1, 3584, dt, False, launch)))
        for launch in L.QK_BWD_CANDIDATES:
            cases.append((f"qk_bwd 24x128 [{launch.label()}] {dn}", R, "_qk_bwd_chunk_kernel", qk(24, 128, dt, True, launch)))
            cases.append((f"qk_bwd 1x3584 (txt_in) [{launch.label()}] {dn}", R, "_qk_bwd_chunk_kernel", qk(1, 3584, dt, False, launch)))
        fwd_seen, bwd_seen = set(), set()
        for launch in L.LN_CANDIDATES:  # the row grouping does not change the binary: one compile per (ahead, maxnreg, stages)
            fwd = (launch.fwd_ahead, launch.fwd_maxnreg, launch.fwd_stages)
            if fwd not in fwd_seen:
                fwd_seen.add(fwd)
                cases.append((f"ln_fwd 3072 [{_setting(*fwd)}] {dn}", N, "_adaln_mod_fwd_kernel", ln(dt, True, launch)))
            bwd = (launch.bwd_ahead, launch.bwd_maxnreg, launch.bwd_stages)
            if bwd not in bwd_seen:
                bwd_seen.add(bwd)
                cases.append((f"ln_bwd 3072 [{_setting(*bwd)}] {dn}", N, "_adaln_mod_bwd_kernel", ln(dt, False, launch)))
    return cases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--triton", required=True, help="an unpacked Triton 3.6 wheel (the directory holding triton/)")
    p.add_argument("--sass-dir", default=None, help="also write every kernel's SASS and TTGIR here")
    args = p.parse_args(argv)
    triton_dir = use_wheel(args.triton)
    import torch
    import triton

    from mmdit_strict.kernels.triton import norms as N
    from mmdit_strict.kernels.triton import rope as R

    from benchmarks import row_launches as L

    rows: list[dict] = []
    compile_cls = _compiler(triton_dir, Path(args.sass_dir) if args.sass_dir else None, rows)
    for mod in (R, N):  # the launchers pick compile options as on the GPU, and take CPU tensors
        mod.interpreting = lambda: False
    for label, mod, attr, call in _cases(torch, R, N):
        saved = getattr(mod, attr)
        setattr(mod, attr, compile_cls(saved, label))
        try:
            call()
        except _Stop:
            pass
        finally:
            setattr(mod, attr, saved)
    print(f"Triton {triton.__version__} from {triton_dir}, sm_90, enable_fp_fusion=False")
    print("\n| kernel (shape, variant, dtype) | warps | regs | stack B | shared B | " + " | ".join(COUNTED)
          + " | loop instr | loop " + " | loop ".join(COUNTED) + " |")
    print("|---|---|---|---|---|" + "---|" * (2 * len(COUNTED) + 1))
    for r in rows:
        print(f"| {r['label']} | {r['warps']} | {r['regs']} | {r['stack']} | {r['shared']} | " + " | ".join(str(r["all"][c]) for c in COUNTED)
              + f" | {r['loop_len']} | " + " | ".join(str(r["loop"][c]) for c in COUNTED) + " |")
    print("\n| kernel | tt.reduce (axis, operands): operand layout |\n|---|---|")
    for r in rows:
        print(f"| {r['label']} | " + "<br>".join(f"axis {a}, {n}: {lay}" for a, n, lay in r["reduces"]) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

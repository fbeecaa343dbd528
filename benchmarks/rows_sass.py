"""Offline sm_90 compile of the row operators' kernel variants: registers, spills, barriers per loop iteration.

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
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

COUNTED = ("STL", "LDL", "BAR", "SHFL", "STS", "LDS", "LDG")


class _Stop(Exception):
    """Raised by a patched launch once its kernel is compiled: the host function goes no further."""


def _instructions(sass: str) -> list[tuple[int, str, str]]:
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2), m.group(3)))
    return out


def _counts(ops: list[str]) -> dict[str, int]:
    c: collections.Counter = collections.Counter()
    for op in ops:
        for name in COUNTED:
            if op == name or op.startswith(name + "."):
                c[name] += 1
    return {name: c[name] for name in COUNTED}


def _main_loop(ins: list[tuple[int, str, str]]) -> list[str]:
    """Opcodes of the longest loop: from a backward branch's target to the branch."""
    index = {a: i for i, (a, _, _) in enumerate(ins)}
    best: list[str] = []
    for i, (a, op, rest) in enumerate(ins):
        t = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        j = index.get(int(t.group(1), 16)) if t and int(t.group(1), 16) < a else None
        if j is not None and i + 1 - j > len(best):
            best = [o for _, o, _ in ins[j:i + 1]]
    return best


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
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.compiler import compile as triton_compile
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    cuobjdump = str(triton_dir / "triton" / "backends" / "nvidia" / "bin" / "cuobjdump")

    class Compile:
        def __init__(self, fn, label: str) -> None:
            self.fn, self.label = fn, label

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                backend = make_backend(target)
                binder = create_function_from_signature(self.fn.signature, self.fn.params, backend)
                bound, specialization, options = binder(*args, **kwargs)
                options, signature, constexprs, attrs = self.fn._pack_args(backend, kwargs, bound, specialization, options)
                kernel = triton_compile(ASTSource(self.fn, signature, constexprs, attrs), target=target, options=options.__dict__)
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(kernel.asm["cubin"])
                    f.flush()
                    res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
                    sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
                if sass_dir is not None:
                    sass_dir.mkdir(parents=True, exist_ok=True)
                    (sass_dir / f"{self.label}.sass").write_text(sass)
                    (sass_dir / f"{self.label}.ttgir").write_text(kernel.asm["ttgir"])
                usage = dict(re.findall(r"(REG|STACK):(\d+)", res))
                ins = _instructions(sass)
                loop = _main_loop(ins)
                rows.append({"label": self.label, "kernel": self.fn.__name__, "warps": options.num_warps,
                             "regs": int(usage.get("REG", -1)), "stack": int(usage.get("STACK", -1)),
                             "all": _counts([o for _, o, _ in ins]), "loop_len": len(loop), "loop": _counts(loop),
                             "reduces": _reduces(kernel.asm["ttgir"])})
                raise _Stop

            return launch

    return Compile


def _cases(torch, R, N):
    """(label, module, kernel attribute, host call) for every kernel variant at the bench's shapes."""
    def qk(h, d, dt, rope, bwd):
        x = torch.zeros(64, h, d, dtype=dt)
        gain, rstd = torch.ones(d, dtype=dt), torch.zeros(64, h)
        cs = torch.zeros(64, d // 2) if rope else None
        return lambda: R.qk_norm_bwd(x, x, gain, rstd, cs, cs, (64,), True, layout="contiguous", bwd=bwd)

    def ln(dt, fwd, variant):
        x, v, st = torch.zeros(64, 3072, dtype=dt), torch.zeros(1, 3072, dtype=dt), torch.zeros(64)
        if fwd:
            return lambda: N.adaln_modulation_fwd(x, v, v, (64,), 1e-6, True, variant=variant)
        return lambda: N.adaln_modulation_bwd(x, x, v, st, st, (64,), True, variant=variant)

    cases = []
    for dn, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for bwd, attr in (("token_heads", "_qk_bwd_kernel"), ("chunk_heads", "_qk_bwd_chunk_kernel")):
            cases.append((f"qk_bwd 24x128 {bwd} {dn}", R, attr, qk(24, 128, dt, True, bwd)))
            cases.append((f"qk_bwd 1x3584 (txt_in) {bwd} {dn}", R, attr, qk(1, 3584, dt, False, bwd)))
        for variant, fwd_attr, bwd_attr in (("one_row", "_adaln_mod_fwd_kernel", "_adaln_mod_bwd_kernel"),
                                            ("two_rows", "_adaln_mod_fwd2_kernel", "_adaln_mod_bwd2_kernel")):
            cases.append((f"ln_fwd 3072 {variant} {dn}", N, fwd_attr, ln(dt, True, variant)))
            cases.append((f"ln_bwd 3072 {variant} {dn}", N, bwd_attr, ln(dt, False, variant)))
    return cases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--triton", required=True, help="an unpacked Triton 3.6 wheel (the directory holding triton/)")
    p.add_argument("--sass-dir", default=None, help="also write every kernel's SASS and TTGIR here")
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

    from mmdit_strict.kernels.triton import norms as N
    from mmdit_strict.kernels.triton import rope as R

    rows: list[dict] = []
    compile_cls = _compiler(triton_dir, Path(args.sass_dir) if args.sass_dir else None, rows)
    for mod in (R, N):  # the launchers pick compile options as on the GPU, and take CPU tensors
        mod._interpreting = lambda: False
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
    print("\n| kernel (shape, variant, dtype) | warps | regs | stack B | " + " | ".join(COUNTED)
          + " | loop instr | loop " + " | loop ".join(COUNTED) + " |")
    print("|---|---|---|---|" + "---|" * (2 * len(COUNTED) + 1))
    for r in rows:
        print(f"| {r['label']} | {r['warps']} | {r['regs']} | {r['stack']} | " + " | ".join(str(r["all"][c]) for c in COUNTED)
              + f" | {r['loop_len']} | " + " | ".join(str(r["loop"][c]) for c in COUNTED) + " |")
    print("\n| kernel | tt.reduce (axis, operands): operand layout |\n|---|---|")
    for r in rows:
        print(f"| {r['label']} | " + "<br>".join(f"axis {a}, {n}: {lay}" for a, n, lay in r["reduces"]) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

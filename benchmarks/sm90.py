"""Offline sm_90 builds of our Triton kernels with an unpacked Triton wheel: no GPU needed.

The tools in this folder (``attention_sass``, ``rows_sass``) replace a kernel's launch by a compile for
Hopper (its ``ptxas``), then read the cubin's resource usage and SASS with the wheel's ``cuobjdump``.
Triton's internal compile entry points are version specific: this is written against 3.6, the H200
image's version.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def use_wheel(path: str) -> Path:
    """Check ``path`` is an unpacked Triton wheel and put it first on ``sys.path`` (before any triton import)."""
    triton_dir = Path(path).resolve()
    if not (triton_dir / "triton" / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        raise ValueError(f"{triton_dir} holds no unpacked Triton wheel (triton/backends/nvidia/bin/cuobjdump missing)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError("unset TRITON_INTERPRET: the kernels must be built for the GPU compiler")
    if any(m == "triton" or m.startswith("triton.") for m in sys.modules):
        raise ValueError("triton was imported before --triton could be put first on sys.path")
    sys.path.insert(0, str(triton_dir))
    return triton_dir


def instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every instruction line of a ``cuobjdump -sass`` listing."""
    out = []
    for line in sass.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2), m.group(3)))
    return out


def count_ops(ops: list[str], counted: tuple[str, ...]) -> dict[str, int]:
    """How many of ``ops`` are each opcode of ``counted`` (a name counts its dotted forms too)."""
    c: collections.Counter = collections.Counter()
    for op in ops:
        for name in counted:
            if op == name or op.startswith(name + "."):
                c[name] += 1
    return {name: c[name] for name in counted}


def loop_bodies(ins: list[tuple[int, str, str]]) -> list[list[str]]:
    """Opcode lists of every loop: from a backward branch's target to the branch, in listing order."""
    index = {a: i for i, (a, _, _) in enumerate(ins)}
    bodies = []
    for i, (a, op, rest) in enumerate(ins):
        t = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        j = index.get(int(t.group(1), 16)) if t and int(t.group(1), 16) < a else None
        if j is not None:
            bodies.append([o for _, o, _ in ins[j:i + 1]])
    return bodies


@dataclass
class Build:
    """One kernel built for sm_90: resource usage and listings."""

    kernel: Any  # Triton's compiled kernel (``asm["ttgir"]``, ``asm["cubin"]`` …)
    num_warps: int
    regs: int
    stack: int
    sass: str


class Sm90Compiler:
    """``compiler.wrap(fn, on_build)``: an object launched like ``fn[grid](...)`` that builds instead of running."""

    def __init__(self, triton_dir: Path) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)
        self.cuobjdump = str(triton_dir / "triton" / "backends" / "nvidia" / "bin" / "cuobjdump")

    def build(self, fn: Any, args: tuple, kwargs: dict) -> Build:
        """Compile ``fn`` with the specialization a launch with ``args`` / ``kwargs`` would get."""
        from triton.compiler import ASTSource, make_backend
        from triton.compiler import compile as triton_compile
        from triton.runtime.jit import create_function_from_signature

        backend = make_backend(self.target)
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        source = ASTSource
        if getattr(fn, "is_gluon", lambda: False)():
            from triton.experimental.gluon._runtime import GluonASTSource as source
        kernel = triton_compile(source(fn, signature, constexprs, attrs), target=self.target, options=options.__dict__)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            res = subprocess.run([self.cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
            sass = subprocess.run([self.cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = dict(re.findall(r"(REG|STACK):(\d+)", res))
        return Build(kernel, options.num_warps, int(usage.get("REG", -1)), int(usage.get("STACK", -1)), sass)

    def wrap(self, fn: Any, on_build) -> Any:
        """A stand-in for ``fn`` whose ``[grid](*args, **kwargs)`` calls ``on_build(build, kwargs)`` instead of launching."""
        compiler = self

        class _Launcher:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    return on_build(compiler.build(fn, args, kwargs), kwargs)

                return launch

        return _Launcher()

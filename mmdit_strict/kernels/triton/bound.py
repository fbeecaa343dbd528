"""Bound launches: a Triton kernel called through its compiled handle once Triton has compiled it for the call.

``kernel[grid](*args, **kw)`` makes Triton re-derive every argument's specialization, build a string cache key,
re-check the kernel's globals and assemble launch metadata on each call: about 32 µs of host time per launch
on the H200's host at f1e536d, against 21 µs for the compiled kernel's own launcher. :func:`bound` keys each
call on what Triton's specialization is a function of, and no less:

* a tensor: its dtype and whether its address is 16-byte aligned;
* an int (and a bool): its value; a float: only that it is one (Triton passes every float as fp32);
* a host tensor descriptor: its base's dtype and alignment, shape, strides, block shape and padding;
* a tuple: its items' keys; any other value (constexprs, compile options): itself;

plus the keyword names and the current device. The first call of a key goes through Triton (which compiles
or finds the kernel) and the compiled kernel it returns is kept; later calls of that key hand the same
arguments to that kernel's launcher on the current stream. The same binary gets the same arguments, so
the bytes cannot differ from Triton's own launch.

Triton's path is kept for every call when the kernel runs in the interpreter (``TRITON_INTERPRET=1``), when
a launch hook is installed (profilers such as proton read launch metadata), and for a callable grid.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

_MAX_KEYS = 4096  # per kernel; a run's layouts need tens


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints (host code; ``triton.cdiv`` is a constexpr function, slow to call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` for ``n >= 1`` (0 for 0), as ``triton.next_power_of_2`` but plain Python."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def arg_key(a: Any) -> Any:
    """What Triton's specialization of argument ``a`` depends on (a superset of it), as a hashable value."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    if isinstance(a, bool):
        return ("bool", a)
    if isinstance(a, int):
        return a
    if isinstance(a, float):
        return float
    if isinstance(a, tuple):
        return tuple(arg_key(x) for x in a)
    if isinstance(a, TensorDescriptor):
        base = a.base
        return ("desc", base.dtype, base.data_ptr() & 15 == 0, tuple(a.shape), tuple(a.strides),
                tuple(a.block_shape), a.padding)
    return a


def _hooked() -> bool:
    """Whether a launch hook is installed (a hook chain with calls, or a plain callable)."""
    rt = knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


class BoundKernel:
    """A JIT kernel's launches, bound per specialization key (see the module docstring). Call it as the kernel:
    ``bound(kernel)[grid](*args, **kw)``; returns the compiled kernel, as Triton's launch does."""

    def __init__(self, kernel: JITFunction) -> None:
        self.kernel = kernel
        params = kernel.params
        self._names = [p.name for p in params]
        self._defaults = {p.name: p.default for p in params if p.has_default}
        self._entries: dict[tuple, tuple] = {}
        self._lock = threading.Lock()
        self.hits = 0  # launches that skipped Triton's binder (read by tests and benchmarks)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        return lambda *args, **kw: self.launch(grid, args, kw)

    def launch(self, grid: tuple[int, ...], args: tuple, kw: dict[str, Any]) -> Any:
        if callable(grid) or _hooked():
            return self.kernel[grid](*args, **kw)
        device = torch.cuda.current_device()
        key = (device, tuple(map(arg_key, args)), tuple((k, arg_key(v)) for k, v in kw.items()))
        entry = self._entries.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **kw)
            if compiled is None:
                return None
            tail = tuple(self._names[len(args):])
            missing = [n for n in tail if n not in kw and n not in self._defaults]
            if missing:  # Triton accepted the call, so this cannot happen; keep its path rather than guess
                return compiled
            entry = (compiled, compiled.run, compiled.function, compiled.packed_metadata, tail)
            with self._lock:
                if len(self._entries) >= _MAX_KEYS:
                    self._entries.clear()
                self._entries[key] = entry
            return compiled
        compiled, run, function, metadata, tail = entry
        values = args + tuple(kw[n] if n in kw else self._defaults[n] for n in tail)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        run(grid[0], g1, g2, driver.active.get_current_stream(device), function, metadata, None, None, None, *values)
        self.hits += 1
        return compiled


_BOUND: dict[int, tuple[Any, Any]] = {}


def bound(kernel: Any) -> Any:
    """``kernel``'s bound launches (one :class:`BoundKernel` per kernel); an interpreted kernel is returned as is."""
    hit = _BOUND.get(id(kernel))
    if hit is not None and hit[0] is kernel:
        return hit[1]
    b = BoundKernel(kernel) if isinstance(kernel, JITFunction) else kernel
    _BOUND[id(kernel)] = (kernel, b)
    return b

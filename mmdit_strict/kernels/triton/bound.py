"""Bound launches: a Triton kernel called through its compiled handle once Triton has compiled it for the call.

``kernel[grid](*args, **kw)`` makes Triton derive every argument's specialization, turn it into a string cache
key, re-check the kernel's globals and assemble launch metadata on each call: about twice the host time of the
compiled kernel's own launcher for one GEMM launch (``benchmarks/launch_cost_probe.py``). A :class:`BoundKernel`
keeps the compiled kernel Triton returned for each key and hands later calls of that key straight to its
launcher, on the current stream:

* :meth:`BoundKernel.launch` (``bound(kernel)[grid](*args, **kw)``) keys a call by Triton's own binder: the
  specialization list and compile options Triton's cache key is made of, so the kernel it reuses is exactly
  the one Triton would pick.
* :meth:`BoundKernel.launch_keyed` takes the key from the caller, skipping the binder too. The caller's key
  must determine Triton's specialization of every argument: each tensor's dtype and 16-byte alignment, each
  int's value (Triton specializes on 1 and on divisibility by 16), every constexpr and compile option. The
  GEMM engine's main kernel uses it (``gemm/launch.py``: its launch plan's key).

The first call of a key always goes through Triton, which compiles or finds the kernel. The same binary gets
the same arguments, so the bytes cannot differ from Triton's own launch. Triton's path is kept for every
call when the kernel runs in the interpreter (``TRITON_INTERPRET=1``: :func:`bound` returns the kernel
itself), when a launch hook is installed (profilers such as proton read launch metadata), and for a callable
grid. Triton's debug and instrumentation knobs are read at a key's first call, not re-read later.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable

import torch
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

_MAX_KEYS = 4096  # per kernel; a run's layouts need tens


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints (host code; ``triton.cdiv`` is a constexpr function, slow to call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` for ``n >= 1`` (0 for 0), as ``triton.next_power_of_2`` but plain Python."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def _hooked() -> bool:
    """Whether a launch hook is installed (a hook chain with calls, or a plain callable)."""
    rt = knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


class BoundKernel:
    """A JIT kernel's launches, bound per key (see the module docstring). ``bound(kernel)[grid](*args, **kw)``
    launches as ``kernel[grid](*args, **kw)`` does and returns the compiled kernel, as Triton's launch does."""

    def __init__(self, kernel: JITFunction) -> None:
        self.kernel = kernel
        self._names = [p.name for p in kernel.params]
        self._defaults = {p.name: p.default for p in kernel.params if p.has_default}
        self._entries: dict[Hashable, tuple] = {}
        self._lock = threading.Lock()
        self.hits = 0  # launches that went straight to a bound kernel (read by tests and benchmarks)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        return lambda *args, **kw: self.launch(grid, args, kw)

    def launch(self, grid: tuple[int, ...], args: tuple, kw: dict[str, Any]) -> Any:
        """Launch keyed by Triton's binder (its specialization and options)."""
        if callable(grid) or _hooked():
            return self.kernel[grid](*args, **kw)
        device = torch.cuda.current_device()
        bound_args, specialization, options = self.kernel.device_caches[device][4](*args, **kw)
        key = (device, tuple(specialization), tuple(options.items()))
        entry = self._entries.get(key)
        if entry is None:
            return self._bind(key, grid, args, kw, None)
        return self._run(entry, grid, device, tuple(bound_args.values()))

    def launch_keyed(self, key: Hashable, grid: tuple[int, ...], args: tuple, kw: dict[str, Any]) -> Any:
        """Launch keyed by ``key``, which must determine Triton's specialization (module docstring); ``args``
        positional, ``kw`` the remaining parameters and the compile options."""
        if _hooked():
            return self.kernel[grid](*args, **kw)
        device = torch.cuda.current_device()
        key = (device, key)
        entry = self._entries.get(key)
        if entry is None:
            return self._bind(key, grid, args, kw, tuple(self._names[len(args):]))
        return self._run(entry, grid, device, args + tuple(kw[n] if n in kw else self._defaults[n] for n in entry[4]))

    def _bind(self, key: Hashable, grid: tuple[int, ...], args: tuple, kw: dict[str, Any], tail: tuple | None) -> Any:
        compiled = self.kernel[grid](*args, **kw)
        if compiled is None:
            return None
        if tail is not None and any(n not in kw and n not in self._defaults for n in tail):
            return compiled  # Triton accepted a call whose parameters this cannot fill: keep Triton's path for it
        with self._lock:
            if len(self._entries) >= _MAX_KEYS:
                self._entries.clear()
            self._entries[key] = (compiled, compiled.run, compiled.function, compiled.packed_metadata, tail)
        return compiled

    def _run(self, entry: tuple, grid: tuple[int, ...], device: int, values: tuple) -> Any:
        compiled, run, function, metadata, _ = entry
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

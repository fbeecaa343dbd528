"""Context-local state set for a block of code: one way to bind a ``ContextVar`` and restore it.

The state that decides the bytes of an operator call (runtime mode, GEMM stream, operator trace and
capture, fault injection, gradient sink and sample keys, keep-alive list) is one execution context
(``kernels/execution.py``). Kernel-local settings outside it (``kernels/choice.py``'s ``KernelSetting``)
are each a ``ContextVar`` bound with :func:`bound` inside a context manager, never a mutable module
global: the value holds in the block (and in the threads and tasks that copy its context) and the
previous one is back after it, also on an error.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def bound(var: contextvars.ContextVar[T], value: T) -> Iterator[T]:
    """``var`` holds ``value`` inside the block; yields ``value``; the previous value is restored on exit."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)

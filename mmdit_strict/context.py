"""Context-local state set for a block of code: one way to bind a ``ContextVar`` and restore it.

Every switch and collector of the package (runtime mode, kernel variant choices, operator trace and
capture, fault injection, gradient sinks, keep-alive lists) is a ``ContextVar`` bound with
:func:`bound` inside a context manager, never a mutable module global: the value holds in the block (and
in the threads and tasks that copy its context) and the previous one is back after it, also on an error.
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

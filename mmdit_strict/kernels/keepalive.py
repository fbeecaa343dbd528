"""Keep cached device tables alive for as long as a CUDA graph that read them.

Kernels read per-layout tables (row offsets, tile schedules, RoPE tables) from caches so that a
repeated batch layout copies nothing from the host. A captured CUDA graph stores the raw addresses of
those tables; if a cache later drops an entry, the graph would read freed memory. Every cache lookup
passes what it returns through :func:`retain`; while :func:`retaining` is active (a graph capture),
the objects are collected into a list the graph keeps (the ``keepalive`` field of the execution
context, :mod:`.execution`). A backward runs on autograd's device thread, which does not see the
capturing thread's context: ``retaining(every_thread=True)`` also collects what any thread retains while
the block is active (one capture at a time, as CUDA graph captures are).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, TypeVar

from .execution import bind, current

T = TypeVar("T")

_EVERY_THREAD: list[list[Any]] = []  # collectors of retaining(every_thread=True) blocks now active


def retain(obj: T) -> T:
    """Return ``obj``; inside :func:`retaining`, also hold a reference to it."""
    sink = current().keepalive
    if sink is not None:
        sink.append(obj)
    for held in _EVERY_THREAD:
        if held is not sink:
            held.append(obj)
    return obj


@contextlib.contextmanager
def retaining(every_thread: bool = False) -> Iterator[list[Any]]:
    """Collect every object passed to :func:`retain` inside the block (``every_thread``: by any thread
    while the block is active, not only in this context)."""
    held: list[Any] = []
    if every_thread:
        _EVERY_THREAD.append(held)
    try:
        with bind(current().replace(keepalive=held)):
            yield held
    finally:
        if every_thread:
            _EVERY_THREAD.remove(held)

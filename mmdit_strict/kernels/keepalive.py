"""Keep cached device tables alive for as long as a CUDA graph that read them.

Kernels read per-layout tables (row offsets, tile schedules, RoPE tables) from caches so that a
repeated batch layout copies nothing from the host. A captured CUDA graph stores the raw addresses of
those tables; if a cache later drops an entry, the graph would read freed memory. Every cache lookup
passes what it returns through :func:`retain`; while :func:`retaining` is active (a graph capture),
the objects are collected into a list the graph keeps (the ``keepalive`` field of the execution
context, :mod:`.execution`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, TypeVar

from .execution import bind, current

T = TypeVar("T")


def retain(obj: T) -> T:
    """Return ``obj``; inside :func:`retaining`, also hold a reference to it."""
    sink = current().keepalive
    if sink is not None:
        sink.append(obj)
    return obj


@contextlib.contextmanager
def retaining() -> Iterator[list[Any]]:
    """Collect every object passed to :func:`retain` inside the block."""
    held: list[Any] = []
    with bind(current().replace(keepalive=held)):
        yield held

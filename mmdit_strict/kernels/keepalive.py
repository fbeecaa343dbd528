"""Keep cached device tables alive for as long as a CUDA graph that read them.

Kernels read per-layout tables (row offsets, tile schedules, RoPE tables) from caches so that a
repeated batch layout copies nothing from the host. A captured CUDA graph stores the raw addresses of
those tables; if a cache later drops an entry, the graph would read freed memory. Every cache lookup
passes what it returns through :func:`retain`; while :func:`retaining` is active (a graph capture),
the objects are collected into a list the graph keeps.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, TypeVar

from ..context import bound

T = TypeVar("T")
_SINK: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("mmdit_keepalive", default=None)


def retain(obj: T) -> T:
    """Return ``obj``; inside :func:`retaining`, also hold a reference to it."""
    sink = _SINK.get()
    if sink is not None:
        sink.append(obj)
    return obj


@contextlib.contextmanager
def retaining() -> Iterator[list[Any]]:
    """Collect every object passed to :func:`retain` inside the block."""
    with bound(_SINK, []) as held:
        yield held

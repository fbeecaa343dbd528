"""Many processes, the same bytes: rollout, recompute and training across ``torchrun`` ranks (docs/distributed.md).

Outside ``torchrun`` nothing here acts: :func:`current` is None, :class:`SidePlan` gives the
single-process layout, and every exchange is a no-op.
"""

from __future__ import annotations

from . import fold
from .agree import agree, agree_config
from .runtime import (PeerFailed, Session, Traffic, all_gather, current, finish, from_root, gather_to_root, is_root,
                      launched, session, stage, status, tag, traffic)
from .side import SidePlan

__all__ = ["PeerFailed", "Session", "SidePlan", "Traffic", "agree", "agree_config", "all_gather", "current", "finish",
           "from_root", "gather_to_root", "is_root", "launched", "session", "stage", "status", "tag", "traffic", "root_context"]

import contextlib
from typing import Any, Callable, ContextManager, Iterator


@contextlib.contextmanager
def root_context(label: str, make: Callable[[], ContextManager[Any]], fallback: Any) -> Iterator[Any]:
    """Enter ``make()`` on rank 0 only (e.g. claiming the output folder); the other ranks get ``fallback``.

    A failure to enter on rank 0 stops every rank. In a single process ``make()`` is simply entered.
    """
    if current() is None:
        with make() as value:
            yield value
        return
    with contextlib.ExitStack() as stack:
        value = fallback
        with stage(label):
            if is_root():
                value = stack.enter_context(make())
        yield value

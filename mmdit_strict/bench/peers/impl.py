"""What a peer adapter hands the harness: an implementation of one of our operators, or why there is none."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager


def no_context() -> ContextManager[None]:
    """The context of an implementation that needs none."""
    return contextlib.nullcontext()


@dataclass(frozen=True)
class Impl:
    """One implementation of one case (``cases.Case``) by one peer.

    ``fn(*packed, *shared, seqlens=(stream 0 lengths, [stream 1 lengths])) -> tuple of outputs`` (rows
    first, the case's ``out_streams``); ``context()`` is entered around every forward *and* backward (a
    global mode such as ``torch.use_deterministic_algorithms`` or Megatron's batch-invariant mode);
    ``note`` says in one line what runs (kernels, composition, flags).
    """

    peer: str
    name: str
    op: str
    fn: Callable[..., tuple]
    note: str
    context: Callable[[], ContextManager[None]] = field(default=no_context)


@dataclass(frozen=True)
class Missing:
    """A peer that offers nothing for ``op`` here, and why (not installed, needs CUDA, no such operator)."""

    peer: str
    name: str
    op: str
    reason: str

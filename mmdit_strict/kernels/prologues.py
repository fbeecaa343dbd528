"""One evaluation per forward of a GEMM prologue that many products apply to the same tensor.

Every modulation product of the strict model (two per block, and the final AdaLN's) reads ``SiLU(temb)``
of the one timestep embedding. The GEMM engines evaluate an elementwise prologue as its own pass before
the product; inside :func:`shared_prologues` (the strict forward enters it) the first pass over a tensor
is kept and every later product reading the same tensor, unchanged, takes it: one launch per forward
instead of one per product (121 for Qwen-Image's 60 blocks). A gradient-checkpoint recompute runs in
the forward's context (:func:`~mmdit_strict.kernels.execution.in_context`), so it takes the forward's
result too. The kept tensor is what the pass would compute again (the same elementwise kernel on the
same bytes), so no output changes.

A result is reused only for the very tensor object it was computed from, at the same version counter
(an in-place change to that tensor is a miss), and only for the same activation. The memo holds its
results as long as the context that holds it lives (the forward's autograd graph, for checkpoints).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterator

import torch

from .execution import bind, current

Compute = Callable[[torch.Tensor, str], torch.Tensor]


class PrologueMemo:
    """Prologue results of one forward, keyed by the input tensor's identity and version and the activation."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, str], tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}
        self.evaluations = 0  # passes run
        self.reuses = 0  # passes saved

    def apply(self, x: torch.Tensor, act: str, compute: Compute) -> torch.Tensor:
        """``compute(x, act)``, or its result kept from an earlier call on this same, unchanged ``x``."""
        if x.is_inference():  # no version counter to tell an in-place change: never reuse
            return compute(x, act)
        key = (id(x), act)
        kept = self._entries.get(key)
        if kept is not None and kept[0]() is x and kept[1] == x._version:
            self.reuses += 1
            return kept[2]
        h = compute(x, act)
        self._entries[key] = (weakref.ref(x), x._version, h)
        self.evaluations += 1
        return h


def prologue_pass(x: torch.Tensor, act: str, compute: Compute) -> torch.Tensor:
    """``compute(x, act)`` through the memo of the execution context in force, if any (else run it)."""
    memo = current().prologues
    return compute(x, act) if memo is None else memo.apply(x, act, compute)


@contextlib.contextmanager
def shared_prologues() -> Iterator[PrologueMemo]:
    """A fresh :class:`PrologueMemo` in force for the block (the ``prologues`` field of the execution context)."""
    memo = PrologueMemo()
    with bind(current().replace(prologues=memo)):
        yield memo

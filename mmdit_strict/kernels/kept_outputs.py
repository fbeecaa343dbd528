"""Outputs an operator keeps from a checkpointed forward for the recompute of the same call.

Under gradient checkpointing the backward runs each block's forward again to rebuild what its operators saved.
Joint attention is the most expensive operator of that recompute for what its outputs weigh: its output is
``(rows, H·d)`` in the execution dtype and its softmax statistics ``(H, rows)`` FP32, against a forward of
``O(rows² · H · d)``. During a checkpointed training forward the strict model binds a :class:`KeptOutputs` in
the execution context (``kept_outputs``) and names each attention call's slot (``at("block3.joint")``, in the
forward and, through the forward's context, in its recompute). An operator that supports it runs its kernel
once: the first call of a slot computes and keeps the result, the recompute's call of the same slot takes it
back (and lets it go), so the recompute's saved tensors are the forward's own bytes. A slot taken twice (a
second backward through a retained graph) simply runs again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


class KeptOutputs:
    """Per-slot outputs of one checkpointed forward, held from its first call to the recompute's."""

    def __init__(self) -> None:
        self._held: dict[str, Any] = {}
        self.slot: str | None = None
        self.kept = 0  # computations kept for a recompute
        self.reused = 0  # recompute calls served from what was kept

    @contextlib.contextmanager
    def at(self, slot: str) -> Iterator[None]:
        """Operator calls inside the block belong to ``slot`` (one call per slot)."""
        previous, self.slot = self.slot, slot
        try:
            yield
        finally:
            self.slot = previous

    def run(self, compute: Callable[[], Any]) -> Any:
        """``compute()`` for the slot in force, or what its first call kept (then let go). Outside a slot: ``compute()``."""
        slot = self.slot
        if slot is None:
            return compute()
        if slot in self._held:
            self.reused += 1
            return self._held.pop(slot)
        out = compute()
        self._held[slot] = out
        self.kept += 1
        return out

    def __len__(self) -> int:
        return len(self._held)

"""One side (rollout or recompute) on many ranks: its batches, sample ownership and the per-step gather.

:class:`SidePlan` is what the side's loop asks; in a single process it answers with the
single-process layout and moves nothing, so the loop runs exactly as it always did.

Per step, every rank runs its own batches (:mod:`.layout`) and records its rows; :meth:`SidePlan.end_step`
then moves each rank's rows of that step (v, x_{t+1}, logp, per-block hashes and the side's per-step
extra, e.g. gradient partials) to rank 0, which puts them at their global sample positions. Rank 0
alone keeps the step checkpoint and writes the artifact, so its tensors are the single-process bytes
whatever the number of ranks: each sample's bytes depend on the sample, never on its rank or batch
(strict mode is batch-invariant, and noise and initial latents are keyed by global sample id).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..kernels.trace import OperatorTrace
from . import layout
from .runtime import current, gather_to_root


class SidePlan:
    """The layout of a side whose single-process visiting order is ``order`` (sample positions), in batches of ``size``."""

    def __init__(self, order: Sequence[int], size: int, group_size: int = 1) -> None:
        """``group_size`` ranks (a model-parallel group, ``mmdit_strict.parallel``) share each batch: the
        samples are split over ``world / group_size`` groups, and a group's first rank owns its rows."""
        s = current()
        self.session = s
        self.world = s.world_size if s is not None else 1
        self.rank = s.rank if s is not None else 0
        if group_size < 1 or self.world % group_size:
            raise ValueError(f"the side's parallel layout groups {group_size} ranks (parallel.tp·sp·cfg): launch with torchrun "
                             f"on a multiple of {group_size} ranks (this run has {self.world})")
        self.group_size = int(group_size)
        groups = self.world // self.group_size
        self.order = list(order)
        self.size = int(size)
        self.per_rank = [layout.rank_batches(self.order, self.size, groups, r // self.group_size) for r in range(self.world)]
        self.batches = self.per_rank[self.rank]  # what this rank runs (with the rest of its group)
        self.owner = {p: g * self.group_size for p, g in layout.owners(self.order, groups).items()}
        self.leader = self.rank % self.group_size == 0

    @property
    def distributed(self) -> bool:
        return self.session is not None

    @property
    def root(self) -> bool:
        return self.rank == 0

    def positions(self) -> list[int]:
        """The sample positions this rank computes."""
        return [p for b in self.batches for p in b]

    def resume(self, rec: Any, load: Callable[[], Any], begin: Callable[[], None]) -> Any:
        """Rank 0 restores a step checkpoint (``load()``; ``begin()`` starts one when there is none).

        Every other rank gets the same resume point and the recorder's restored rows, with an empty
        operator trace and no per-step extras (those stay rank 0's, which writes them). Single
        process: ``load()``, else ``begin()``.
        """
        if self.session is None:
            resumed = load()
            if resumed is None:
                begin()
            return resumed
        import dataclasses

        from .runtime import from_root

        kept: list[Any] = [None]

        def restore() -> Any:
            kept[0] = load()
            if kept[0] is None:
                begin()
                return None
            light = dataclasses.replace(kept[0], trace=OperatorTrace(), step_extras=[])
            return {"resumed": light, "v": rec.v, "x": rec.x, "logp": rec.logp, "blocks": rec.blocks}

        got = from_root("resume: restore the step checkpoint", restore)
        if self.root or got is None:
            return kept[0]
        rec.v.copy_(got["v"])
        rec.x.copy_(got["x"])
        rec.logp.copy_(got["logp"])
        rec.blocks = got["blocks"]
        return got["resumed"]

    def end_step(self, rec: Any, step: int, extra: Any = None) -> list[Any] | None:
        """Move this step's rows of every rank to rank 0 (into ``rec``); return each rank's ``extra`` there.

        Single process: nothing moves and the result is ``None``; on ranks other than 0 also ``None``.
        """
        if self.session is None:
            return None
        mine = self.positions() if self.leader else []  # the group's other ranks hold the same rows
        rows = {p: (rec.v[step, p], rec.x[step + 1, p], rec.logp[step, p], rec.blocks[step][p]) for p in mine}
        got = gather_to_root(f"step {step}: gather rows", {"rows": rows, "extra": extra})
        if got is None:
            return None
        for r, part in enumerate(got):
            for p, (v, x, logp, blocks) in part["rows"].items():
                if self.owner.get(p) != r:
                    raise RuntimeError(f"rank {r} sent sample position {p}, which rank {self.owner.get(p)} owns")
                rec.v[step, p] = v
                rec.x[step + 1, p] = x
                rec.logp[step, p] = logp
                rec.blocks[step][p] = blocks
        return [part["extra"] for part in got]

    def merge_trace(self, trace: OperatorTrace) -> OperatorTrace:
        """Rank 0: its trace plus every other rank's operator calls; elsewhere the rank's own trace."""
        if self.session is None:
            return trace
        got = gather_to_root("merge operator traces", trace.record_dicts())
        if got is not None:
            for r, records in enumerate(got):
                if r != self.rank:
                    trace.merge(OperatorTrace.from_records(records))
        return trace

    def side_fields(self, sample_ids: Sequence[int]) -> dict[str, Any]:
        """What the artifact records about the layout: nothing in a single process; else the world
        size, each sample's owning rank (by sample position) and every rank's batches (sample ids)."""
        if self.session is None:
            return {}
        return {"world_size": self.world,
                "owner_rank": [self.owner[p] for p in range(len(sample_ids))],
                "rank_batches": [[[int(sample_ids[p]) for p in b] for b in batches] for batches in self.per_rank]}

    def write(self, label: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0 (the artifact write), its result moved to every rank."""
        from .runtime import from_root

        return from_root(label, fn)


__all__ = ["SidePlan"]

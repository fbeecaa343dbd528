"""The process groups of a model-parallel layout, and the one object a side's forwards read them from.

:func:`model_parallel` builds the groups once per (layout, session) — every rank creates every group, in
the same order, as ``torch.distributed.new_group`` requires — and binds a :class:`ModelParallel` into the
execution context's ``parallel`` field for the block. The strict forward and the CFG step read it there;
with no layout bound (or a trivial one) nothing changes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ..kernels.execution import bind, current
from .layout import ModelLayout


@dataclass(eq=False)
class ModelParallel:
    """This rank's place in a model-parallel layout: its coordinates and the groups it exchanges with.

    ``tp_group`` / ``sp_group`` / ``cfg_group`` are ``torch.distributed`` groups (None where the degree is 1);
    ``tp_ranks`` / ``sp_ranks`` / ``cfg_ranks`` their global ranks in coordinate order. ``stage`` is True when tensors cross through
    host memory (gloo), as on ranks that share one GPU.
    """

    layout: ModelLayout
    rank: int
    world: int
    tp_group: Any = None
    tp_ranks: tuple[int, ...] = (0,)
    sp_group: Any = None
    sp_ranks: tuple[int, ...] = (0,)
    cfg_group: Any = None
    cfg_ranks: tuple[int, ...] = (0,)
    stage: bool = True
    stats: dict[str, float] = field(default_factory=lambda: {"calls": 0, "bytes": 0})
    _columns: Any = field(default=None, repr=False)

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)["tp"]

    @property
    def sp(self) -> int:
        return self.layout.sp

    @property
    def cfg(self) -> int:
        return self.layout.cfg

    @property
    def sp_rank(self) -> int:
        return self.layout.coords(self.rank)["sp"]

    @property
    def cfg_rank(self) -> int:
        return self.layout.coords(self.rank)["cfg"]

    @property
    def sends_partials(self) -> bool:
        """True on the rank that speaks for its CFG branch: the ``tp · sp`` ranks of a branch compute the same
        per-sample gradient partials (the backward is the one-rank block's on every one), so one sends them."""
        c = self.layout.coords(self.rank)
        return c["sp"] == 0 and c["tp"] == 0

    @property
    def leader(self) -> bool:
        """True on the first rank of the model group."""
        return self.layout.leader(self.rank) == self.rank

    def column_shards(self) -> Any:
        """This rank's :class:`~.tensor.ColumnShards` (``tp > 1``), kept for the session: its weight views and
        shape probes serve every forward."""
        if self._columns is None:
            from .tensor import ColumnShards

            self._columns = ColumnShards(self)
        return self._columns

    def forward(self, model: Any, inputs: Any, block_capture: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """The strict forward of ``inputs`` under this layout (sequence shards when ``sp > 1``, column shards
        when ``tp > 1``)."""
        from .sequence import sharded_forward

        return sharded_forward(self, model, inputs, block_capture)


_BUILT: dict[tuple[ModelLayout, int, int], ModelParallel] = {}


def build(layout: ModelLayout) -> ModelParallel:
    """This rank's :class:`ModelParallel` for ``layout`` in the running ``torchrun`` session (built once)."""
    from .. import distributed

    s = distributed.current()
    if s is None:
        raise RuntimeError(f"parallel layout {layout.describe()} needs several ranks: launch with torchrun "
                           f"(--nproc-per-node a multiple of {layout.size})")
    layout.check(s.world_size)
    key = (layout, s.world_size, id(s))
    got = _BUILT.get(key)
    if got is not None:
        return got
    import torch.distributed as dist

    made: dict[str, tuple[Any, tuple[int, ...]]] = {}
    for axis in ("tp", "sp", "cfg"):
        if getattr(layout, axis) == 1:
            continue
        for ranks in layout.group_ranks(s.world_size, axis):  # every rank creates every group, in one order
            group = dist.new_group(ranks, timeout=None)
            if s.rank in ranks:
                made[axis] = (group, tuple(ranks))
    mp = ModelParallel(layout, s.rank, s.world_size, stage=s.backend == "gloo")
    if "tp" in made:
        mp.tp_group, mp.tp_ranks = made["tp"]
    if "sp" in made:
        mp.sp_group, mp.sp_ranks = made["sp"]
    if "cfg" in made:
        mp.cfg_group, mp.cfg_ranks = made["cfg"]
    _BUILT[key] = mp
    s.on_close.append(lambda: _release(key))
    return mp


def _release(key: tuple) -> None:
    """Destroy the subgroups built for ``key`` and forget them, when their session ends: a subgroup still referenced
    here would otherwise be torn down only at interpreter exit, after its peers may have closed their connections."""
    import torch.distributed as dist

    mp = _BUILT.pop(key, None)
    if mp is None:
        return
    for name in ("tp_group", "sp_group", "cfg_group"):
        group = getattr(mp, name, None)
        if group is not None:
            setattr(mp, name, None)
            dist.destroy_process_group(group)


@contextlib.contextmanager
def model_parallel(layout: ModelLayout | None) -> Iterator[ModelParallel | None]:
    """Bind ``layout``'s :class:`ModelParallel` into the execution context for the block (None or a trivial
    layout binds nothing)."""
    if layout is None or layout.trivial:
        yield None
        return
    mp = build(layout)
    with bind(current().replace(parallel=mp)):
        yield mp


def active() -> ModelParallel | None:
    """The :class:`ModelParallel` in force, or None."""
    return current().parallel

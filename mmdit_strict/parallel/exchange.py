"""Exact exchanges inside a model group: tensors only move, never add (docs/parallel.md).

Every function here is a collective of the group it is given: all its ranks call it in the same order.
With gloo (CPU ranks, or ranks sharing one GPU) device tensors are staged through host memory.
:class:`ReplicatedGather` is the one exchange autograd differentiates: what follows a gather runs
identically on every rank of the group, so each rank's gradient of the gathered tensor is the whole
one-rank gradient, and the backward takes the rank's own part of it — no reduction.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .groups import ModelParallel


def _host(t: torch.Tensor, mp: ModelParallel) -> torch.Tensor:
    return t.detach().cpu().contiguous() if mp.stage and t.is_cuda else t.detach().contiguous()


def _count(mp: ModelParallel, tensors: Sequence[torch.Tensor]) -> None:
    mp.stats["calls"] += 1
    mp.stats["bytes"] += sum(t.numel() * t.element_size() for t in tensors)


def all_gather(mp: ModelParallel, t: torch.Tensor, group: Any, size: int, rows: Sequence[int]) -> list[torch.Tensor]:
    """Every rank's ``t`` (``rows[k]`` rows on rank ``k``, same trailing shape), in rank order, on ``t``'s device."""
    import torch.distributed as dist

    send = _host(t, mp)
    top = max(rows)
    if send.shape[0] != top:  # gloo's all_gather wants equal shapes: pad to the longest part
        send = torch.cat([send, send.new_zeros((top - send.shape[0],) + tuple(send.shape[1:]))])
    got = [torch.empty_like(send) for _ in range(size)]
    dist.all_gather(got, send, group=group)
    _count(mp, [send])
    return [g[:n].to(t.device) for g, n in zip(got, rows)]


def all_to_all(mp: ModelParallel, parts: Sequence[torch.Tensor], group: Any, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Send ``parts[j]`` to rank ``j`` of ``group``; return what rank ``k`` sent here (shape ``shapes[k]``), in order.

    Parts may differ in their first dimension (row shards); gloo wants equal shapes, so every part travels
    padded to the longest and is cut back on arrival."""
    import torch.distributed as dist

    dev, dtype = parts[0].device, parts[0].dtype
    top = max([p.shape[0] for p in parts] + [s[0] for s in shapes])
    send = []
    for p in parts:
        h = _host(p, mp)
        if h.shape[0] != top:
            h = torch.cat([h, h.new_zeros((top - h.shape[0],) + tuple(h.shape[1:]))])
        send.append(h)
    got = [torch.empty((top,) + tuple(s[1:]), dtype=dtype, device=send[0].device) for s in shapes]
    if mp.stage:  # gloo: point-to-point pairs (not every gloo build has all-to-all)
        ranks = list(mp.sp_ranks if group is mp.sp_group else mp.tp_ranks if group is mp.tp_group else mp.cfg_ranks)
        me = ranks.index(mp.rank)
        got[me].copy_(send[me])
        ops = [op for j, r in enumerate(ranks) if j != me
               for op in (dist.P2POp(dist.isend, send[j], r, group), dist.P2POp(dist.irecv, got[j], r, group))]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    else:
        dist.all_to_all(got, send, group=group)
    _count(mp, send)
    return [g[:s[0]].to(dev) for g, s in zip(got, shapes)]


class RowLayout:
    """The packed image rows of a batch split over the ranks of a sequence group.

    ``local[k]`` are rank ``k``'s rows (indices into the packed rows); :meth:`assemble` puts the ranks'
    parts, concatenated in rank order, back at their packed positions.
    """

    def __init__(self, local: Sequence[Sequence[int]], total: int, device: torch.device) -> None:
        self.local = [list(r) for r in local]
        self.counts = [len(r) for r in self.local]
        self.total = total
        order = [i for r in self.local for i in r]
        if sorted(order) != list(range(total)):
            raise ValueError("row shards must cover every packed row exactly once")
        self.order = torch.tensor(order, dtype=torch.long, device=device)
        self.index = [torch.tensor(r, dtype=torch.long, device=device) for r in self.local]

    def assemble(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        cat = torch.cat(list(parts), dim=0)
        out = cat.new_empty((self.total,) + tuple(cat.shape[1:]))
        out.index_copy_(0, self.order, cat)
        return out

    def part(self, full: torch.Tensor, k: int) -> torch.Tensor:
        return full.index_select(0, self.index[k])


def gather_rows(mp: ModelParallel, local: torch.Tensor, rows: RowLayout) -> torch.Tensor:
    """The whole packed tensor from every sequence rank's rows (no autograd)."""
    if mp.sp == 1:
        return local
    return rows.assemble(all_gather(mp, local, mp.sp_group, mp.sp, rows.counts))


def rows_to_heads(mp: ModelParallel, t: torch.Tensor, rows: RowLayout) -> torch.Tensor:
    """Ulysses: this rank's rows of every head ``(n_k, H, d)`` → every row of this rank's heads ``(N, H/sp, d)``."""
    H = t.shape[1]
    h = H // mp.sp
    parts = [t[:, j * h:(j + 1) * h] for j in range(mp.sp)]
    shapes = [(n, h) + tuple(t.shape[2:]) for n in rows.counts]
    return rows.assemble(all_to_all(mp, parts, mp.sp_group, shapes))


def heads_to_rows(mp: ModelParallel, t: torch.Tensor, rows: RowLayout, heads: int) -> torch.Tensor:
    """Ulysses, back: every row of this rank's heads ``(N, H/sp·d)`` → this rank's rows of every head ``(n_k, H·d)``."""
    h = heads // mp.sp
    full = t.reshape(t.shape[0], h, -1)
    parts = [rows.part(full, k) for k in range(mp.sp)]
    mine = rows.counts[mp.sp_rank]
    got = all_to_all(mp, parts, mp.sp_group, [(mine, h, full.shape[2])] * mp.sp)
    return torch.cat(got, dim=1).reshape(mine, -1)


def gather_heads(mp: ModelParallel, t: torch.Tensor, heads: int) -> torch.Tensor:
    """Every sequence rank's heads of replicated rows ``(M, H/sp·d)`` → ``(M, H·d)`` in head order."""
    h = heads // mp.sp
    parts = all_gather(mp, t.reshape(t.shape[0], h, -1), mp.sp_group, mp.sp, [t.shape[0]] * mp.sp)
    return torch.cat(parts, dim=1).reshape(t.shape[0], -1)


class ReplicatedGather(torch.autograd.Function):
    """Forward: gather every rank's part into the whole tensor (identical on each rank). Backward: this rank's
    part of the gradient (the ranks' computations after the gather are identical, so each one holds the
    whole gradient; no sum)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, mp: ModelParallel, gather: Any, part: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.part = part
        return gather(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return ctx.part(grad.contiguous()), None, None, None


def replicated_rows(mp: ModelParallel, local: torch.Tensor, rows: RowLayout) -> torch.Tensor:
    """:func:`gather_rows` that autograd differentiates (backward: this rank's rows of the gradient)."""
    if mp.sp == 1:
        return local
    k = mp.sp_rank
    return ReplicatedGather.apply(local, mp, lambda t: gather_rows(mp, t, rows), lambda g: rows.part(g, k))


def replicated_branches(mp: ModelParallel, mine: torch.Tensor) -> list[torch.Tensor]:
    """CFG-parallel: every branch's ``(B, ...)`` tensor, in branch order, differentiable (backward: this
    rank's branch of the gradient)."""
    n = mine.shape[0]
    k = mp.cfg_rank

    def gather(t: torch.Tensor) -> torch.Tensor:
        return torch.cat(all_gather(mp, t, mp.cfg_group, mp.cfg, [n] * mp.cfg), dim=0)

    both = ReplicatedGather.apply(mine, mp, gather, lambda g: g[k * n:(k + 1) * n])
    return list(both.split(n, dim=0))

"""LoRA-gradient partials of many ranks folded into the single-process bytes.

The fold of a parameter's per-key partials is the pairwise tree over the sorted sample keys
(:mod:`mmdit_strict.kernels.fold_tree`). Two ways to take it across ranks:

* **training** (:func:`merge_update`): each rank owns a contiguous range of the update's sorted keys,
  folds it in a streamed sink into at most ``2·⌈log2 K⌉`` complete tree nodes, and the ranks merge
  those nodes along a binary tree of ranks (rank ``r`` sends to ``r - 2^j`` in round ``j``), so rank 0
  ends with the root, which it broadcasts. Per rank: the sink's open nodes plus one neighbour's
  nodes in memory, and its own nodes out plus the result in. No per-key partial leaves its rank.
* **recompute** (:func:`rank_partials`, :func:`fold_ranks`): the recompute's ranks hold scattered
  keys (its shuffled order), so their per-key partials move whole to rank 0, which folds them in one
  stored sink. That side only records the gradient's hash; it is a diagnostic, not an update.

Either way the additions are the single-process tree's, so the bytes do not depend on the number of ranks.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import torch

from ..kernels.fold_tree import Node, PairwiseFold
from ..kernels.grad_sink import SampleGradSink
from .runtime import current, from_root, receive, send, status


def rank_partials(trainable: Sequence[tuple[str, torch.Tensor]], sink: SampleGradSink) -> dict[str, Any]:
    """This rank's share: the names of the parameters that got a gradient, and their per-key partials (host FP32)."""
    with_grad = [n for n, p in trainable if p.grad is not None]
    parts = {n: {k: t.detach().cpu() for k, t in sink.partials(p).items()} for n, p in trainable if p.grad is not None}
    return {"with_grad": with_grad, "partials": parts}


def fold_ranks(name: str, shares: Sequence[dict[str, Any]]) -> torch.Tensor | None:
    """Parameter ``name``'s fold over every rank's partials in global key order; None when no rank had any."""
    sink = SampleGradSink()
    anchor = torch.empty(0)  # the sink keys parameters by identity: one stand-in for ``name``
    seen: dict[Any, int] = {}
    for r, share in enumerate(shares):
        parts = share["partials"].get(name, {})
        for k in parts:
            if k in seen:
                raise ValueError(f"sample key {k!r} of {name} came from rank {seen[k]} and rank {r}: a sample ran twice")
            seen[k] = r
        if parts:
            keys = list(parts)
            sink.add(anchor, keys, [parts[k] for k in keys], transfer=True)
    return sink.fold(anchor)


def range_nodes(sink: SampleGradSink, param: torch.Tensor, keys: Sequence[Hashable], first: int) -> list[Node]:
    """``param``'s tree nodes over this rank's keys (leaves ``first ..``): the streamed sink's own, or built
    from a stored sink's partials; empty leaves where it got nothing."""
    if sink.streamed:
        nodes = sink.nodes(param)
        if nodes is not None:
            return nodes
        parts: dict[Hashable, torch.Tensor] = {}
    else:
        parts = sink.partials(param)
    f = PairwiseFold(first)
    for k in sorted(keys):
        f.leaf(parts.get(k), owned=False)
    return f.nodes


def merge_update(names: Sequence[str], nodes: dict[str, list[Node]], first: int, label: str) -> dict[str, torch.Tensor | None]:
    """Every parameter's fold over all ranks' key ranges, on every rank (``first``: this rank's first leaf).

    ``nodes[name]`` are this rank's nodes of ``name`` (:func:`range_nodes`); ranks hold consecutive
    ranges in rank order. Single process: the root of this process's nodes.
    """
    s = current()
    folds = {n: PairwiseFold(first) for n in names}
    for n in names:
        folds[n].extend(nodes[n])
    if s is None:
        return {n: folds[n].result() for n in names}
    status(f"{label}: backward done")
    step = 1
    while step < s.world_size:
        if s.rank % (2 * step) == step:  # hand my (already merged) range to the rank on my left, then wait
            send(f"{label}: nodes to rank {s.rank - step}", {n: _plain(folds[n].nodes) for n in names}, s.rank - step)
            break
        if s.rank % (2 * step) == 0 and s.rank + step < s.world_size:
            got = receive(f"{label}: nodes from rank {s.rank + step}", s.rank + step)
            for n in names:
                folds[n].extend(_nodes(got[n], _device(folds[n])))
        step *= 2
    out = from_root(f"{label}: the folded gradient", lambda: {n: folds[n].result() for n in names})
    return out


def _plain(nodes: list[Node]) -> list[tuple[int, int, torch.Tensor | None]]:
    return [(n.level, n.start, n.value) for n in nodes]


def _nodes(plain: list[tuple[int, int, torch.Tensor | None]], device: torch.device | None) -> list[Node]:
    return [Node(lv, st, None if v is None else (v.to(device) if device is not None else v), True) for lv, st, v in plain]


def _device(f: PairwiseFold) -> torch.device | None:
    return next((n.value.device for n in f.nodes if n.value is not None), None)

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
from .runtime import broadcast_tensor, current, from_root, receive, recv_tensor, send, send_tensor, status


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
    ranges in rank order. Single process: the root of this process's nodes. Node values travel as one
    flat tensor per message (the layout — levels, starts, shapes — as a small object before it): on the
    GPU with nccl, through host memory with gloo.
    """
    s = current()
    folds = {n: PairwiseFold(first) for n in names}
    for n in names:
        folds[n].extend(nodes[n])
    if s is None:
        return {n: folds[n].result() for n in names}
    status(f"{label}: backward done")
    device = next((nd.value.device for n in names for nd in folds[n].nodes if nd.value is not None), torch.device("cpu"))
    step = 1
    while step < s.world_size:
        if s.rank % (2 * step) == step:  # hand my (already merged) range to the rank on my left, then wait
            meta, flat = _pack({n: folds[n].nodes for n in names})
            send(f"{label}: node layout to rank {s.rank - step}", meta, s.rank - step)
            if flat.numel():
                send_tensor(f"{label}: nodes to rank {s.rank - step}", flat, s.rank - step)
            break
        if s.rank % (2 * step) == 0 and s.rank + step < s.world_size:
            meta = receive(f"{label}: node layout from rank {s.rank + step}", s.rank + step)
            flat = recv_tensor(f"{label}: nodes from rank {s.rank + step}", meta["numel"], meta["dtype"], device, s.rank + step) \
                if meta["numel"] else torch.empty(0, device=device)
            for n, got in _unpack(meta, flat).items():
                folds[n].extend(got)
        step *= 2
    meta, flat = None, None
    if s.root:
        roots = {n: folds[n].result() for n in names}
        meta, flat = _pack({n: [] if v is None else [Node(0, 0, v)] for n, v in roots.items()})
    meta = from_root(f"{label}: layout of the folded gradient", lambda: meta)
    flat = broadcast_tensor(f"{label}: the folded gradient", flat, meta["numel"], meta["dtype"], device) \
        if meta["numel"] else torch.empty(0, device=device)
    return {n: (got[0].value if got else None) for n, got in _unpack(meta, flat).items()}


def _pack(nodes: dict[str, list[Node]]) -> tuple[dict[str, Any], torch.Tensor]:
    """Node layout (a small object) and every node value flattened into one tensor, in name and node order."""
    layout: dict[str, list[tuple[int, int, tuple[int, ...] | None]]] = {}
    values: list[torch.Tensor] = []
    dtype = None
    for n, nds in nodes.items():
        layout[n] = []
        for nd in nds:
            if nd.value is None:
                layout[n].append((nd.level, nd.start, None))
                continue
            if dtype is None:
                dtype = nd.value.dtype
            elif nd.value.dtype != dtype:
                raise ValueError(f"gradient nodes of one update must share a dtype: {n} is {nd.value.dtype}, not {dtype}")
            layout[n].append((nd.level, nd.start, tuple(nd.value.shape)))
            values.append(nd.value.reshape(-1))
    flat = torch.cat(values) if values else torch.empty(0)
    return {"layout": layout, "numel": flat.numel(), "dtype": dtype or torch.float32}, flat


def _unpack(meta: dict[str, Any], flat: torch.Tensor) -> dict[str, list[Node]]:
    out: dict[str, list[Node]] = {}
    at = 0
    for n, entries in meta["layout"].items():
        out[n] = []
        for level, start, shape in entries:
            if shape is None:
                out[n].append(Node(level, start, None))
                continue
            size = torch.Size(shape).numel()
            out[n].append(Node(level, start, flat[at:at + size].view(shape), True))  # views of a buffer only this fold holds
            at += size
    return out

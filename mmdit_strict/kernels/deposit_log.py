"""The deposit log of a captured training step: what its backward deposited, handed to the real grad sink at each replay.

A captured backward (``model/train_graphs.py``) runs its Python once, at capture, with a :class:`DepositLog` bound
as the grad sink; the log records which buffers hold which tensor's partials (or, folding its batch, which node), and
after every replay gives the real :class:`~.grad_sink.SampleGradSink` the same deposits under that call's keys.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from . import fold_tree
from .grad_sink import SampleGradSink


class DepositLog:
    """A stand-in sink that records deposits instead of folding them, to hand them to a real sink later.

    A captured backward (``model/train_graphs.py``) runs its Python once, at capture, under sample keys
    that are batch positions ``0 .. B-1``; the log keeps each deposit's parameter, positions and
    partials (buffers the graph rewrites at every replay) in arrival order. After each replay,
    :meth:`replay` gives a real sink the same deposits under that call's sample keys, copied where the
    sink keeps them (``transfer=False``), so the sink's fold is the one an uncaptured backward gets.

    ``buffers(param, position, occurrence)``: the tensor the backward writes ``param``'s partial of batch
    position ``position`` into (``occurrence``: how many partials of that pair came before it in this
    backward), or None for a fresh one. Buffers shared by several captured backwards hold one replay's
    partials at a time, which :meth:`replay` hands on before the next replay writes them.

    ``fold``: the batch positions in sorted-key order, for a backward whose call's keys are the leaves of one
    complete node of the sink's tree (``SampleGradSink.node_order``). Once ``buffers`` is set, a deposit of all
    positions of a tensor is folded there and then — its partials added pairwise in that order, the node's value —
    into ``buffers(param, 0, occurrence)``, and the per-sample partials are temporaries: one buffer per tensor instead
    of one per tensor and position, and the sink gets one node (``add_flat_node``) instead of B partials.

    ``accumulate`` (fold mode, set by the capture when nodes are carried): a device flag the folded deposits read at
    every replay; True adds the node into what the buffer holds instead of overwriting it. :meth:`before_replay` sets it
    where the streamed sink carries this call's left sibling in the same flat buffer (``SampleGradSink.carry``), and
    :meth:`replay` then hands the parent node; a call that is a left child is carried in turn.
    """

    def __init__(self, autograd_sums: bool = True,
                 buffers: Callable[[torch.Tensor, int, int], torch.Tensor | None] | None = None,
                 fold: tuple[int, ...] | None = None) -> None:
        self.autograd_sums = autograd_sums  # as the real sink's (SampleGradSink): read by the captured backward
        self.buffers = buffers
        if fold is not None and sorted(fold) != list(range(len(fold))):
            raise ValueError(f"fold must order the batch positions 0 .. B-1, got {fold}")
        self.fold = fold
        self.flat: FlatBuffers | None = None  # flat buffers ``buffers`` hands out views of (one per batch position)
        self._uses: dict[tuple[int, int], int] = {}
        self.entries: list[tuple[torch.Tensor, tuple[int, ...], list[torch.Tensor]]] = []
        self._plan: _FlatPlan | None | bool = False  # False: not worked out yet
        self.accumulate: torch.Tensor | None = None  # 0-d bool on the buffers' device (carried nodes), or None
        self._left: tuple[Hashable, ...] | None = None  # the carried sibling's keys this replay adds into

    def partial_buffers(self, param: torch.Tensor, keys: Sequence[int]) -> list[torch.Tensor] | None:
        """The buffers ``buffers`` gives for ``param`` at batch positions ``keys`` (None unless it gives them all; None
        when folding: the partials are temporaries)."""
        if self.buffers is None or self._folding(keys):
            return None
        found: list[torch.Tensor | None] = []
        for pos in keys:
            n = self._uses.get((id(param), pos), 0)
            self._uses[id(param), pos] = n + 1
            found.append(self.buffers(param, pos, n))
        return None if any(b is None for b in found) else [b for b in found if b is not None]

    def add(self, param: torch.Tensor, keys: Sequence[Hashable], partials: Sequence[torch.Tensor], *,
            transfer: bool = False) -> None:
        """Record one deposit (``keys`` are batch positions: the log is bound with ``sample_keys = range(B)``)."""
        if len(keys) != len(partials):
            raise ValueError(f"{len(keys)} sample keys for {len(partials)} gradient partials")
        if not all(isinstance(k, int) for k in keys):
            raise ValueError("a DepositLog records batch positions: bind sample_keys=range(B) while it is the sink")
        if self._folding(keys):
            n = self._uses.get((id(param), -1), 0)
            self._uses[id(param), -1] = n + 1
            out = self.fold_into(param, n, keys, partials, transfer)
            self.entries.append((param, tuple(range(len(keys))), [out.detach()]))
        else:
            self.entries.append((param, tuple(keys), [p.detach() for p in partials]))
        self._plan = False

    def fold_into(self, param: torch.Tensor, occurrence: int, positions: Sequence[int], partials: Sequence[torch.Tensor],
                  transfer: bool = False) -> torch.Tensor:
        """Fold mode: add ``partials`` (of batch ``positions``) pairwise in :attr:`fold`'s order into ``param``'s buffer
        for that occurrence and return it (what a folding deposit does, and what its captured graph does each replay)."""
        assert self.fold is not None and self.buffers is not None
        out = self.buffers(param, 0, occurrence)
        if out is None:
            raise RuntimeError("DepositLog(fold=...): no buffer for a folded deposit (reserve one per tensor first)")
        at = {pos: part.detach() for pos, part in zip(positions, partials)}
        tree = fold_tree.PairwiseFold(copy_held=False)  # temporaries made for the sink (transfer) are summed in place
        for pos in self.fold:
            tree.leaf(at[pos], owned=transfer)
        node = tree.result()
        if self.accumulate is None:
            return out.copy_(node)
        # the carried left sibling (what ``out`` holds) plus this node: the parent, as the sink's fold would add them
        return torch.where(self.accumulate, out + node, node, out=out)

    def _folding(self, positions: Sequence[int]) -> bool:
        """Whether a deposit at these positions is folded into one node (fold mode, buffers set, every position)."""
        return (self.fold is not None and self.buffers is not None and len(positions) == len(self.fold)
                and sorted(positions) == list(range(len(self.fold))))

    def clear(self) -> None:
        self.entries.clear()
        self._uses.clear()
        self._plan = False

    def before_replay(self, sink: SampleGradSink, keys: Sequence[Hashable]) -> None:
        """Before the backward replay that writes this log's buffers under ``keys``: set :attr:`accumulate` (where the
        sink carries this call's left sibling in this log's flat buffer), else have the sink place a carried node
        first, since the replay rewrites the buffer it waits in."""
        self._left = None
        if not isinstance(sink, SampleGradSink):
            return
        plan = self._flat_plan() if sink.streamed and self.accumulate is not None else None
        if plan is not None and plan.node and not plan.rest:
            self._left = sink.carried_left_of(keys, plan.flats[0], plan.params, plan.offsets)
        if self._left is None:
            sink.flush_carry()
        if self.accumulate is not None:
            self.accumulate.fill_(self._left is not None)

    def replay(self, sink: SampleGradSink, keys: Sequence[Hashable]) -> None:
        """Deposit every recorded partial into ``sink`` under ``keys[position]``: the ones written into
        :attr:`flat` in one :meth:`SampleGradSink.add_flat` (a streamed sink), the rest in the recorded order."""
        plan = self._flat_plan() if sink.streamed else None
        if plan is None:
            for param, positions, partials in self.entries:
                self._hand(sink, param, [keys[i] for i in positions], partials)
            return
        left, self._left = self._left, None
        if plan.node and left is not None:  # the graph added this node into the carried sibling: their parent
            sink.add_flat_node(plan.params, plan.offsets, [*left, *keys], plan.flats[0])
        elif plan.node and self.accumulate is not None and not plan.rest and sink.can_carry(list(keys)):
            sink.carry(plan.params, plan.offsets, list(keys), plan.flats[0])
        elif plan.node:
            sink.add_flat_node(plan.params, plan.offsets, list(keys), plan.flats[0])
        else:
            sink.add_flat(plan.params, plan.offsets, [keys[i] for i in range(len(plan.flats))], plan.flats)
        for param, positions, partials in plan.rest:
            self._hand(sink, param, [keys[i] for i in positions], partials)

    @staticmethod
    def _hand(sink: SampleGradSink, param: torch.Tensor, keys: list[Hashable], partials: list[torch.Tensor]) -> None:
        if len(partials) == 1 and len(keys) > 1:  # a folded deposit: one node for all the call's keys
            sink.add_flat_node([param], [0], keys, partials[0].reshape(-1))
        else:
            sink.add(param, keys, partials, transfer=False)

    def _flat_plan(self) -> "_FlatPlan | None":
        """The recorded deposits that are exactly one partial per batch position for each of some of :attr:`flat`'s
        tensors, written into their views (those tensors are the plan's; the other deposits are its ``rest``), or
        None where there are none or a tensor also deposited elsewhere."""
        if self._plan is False:
            self._plan = self._make_plan()
        assert self._plan is not False
        return self._plan

    def _make_plan(self) -> "_FlatPlan | None":
        """The tensors whose deposits cover their views of the flat buffers exactly once: each batch position's
        partial (or, folding, the one node in the first buffer); None if there are none or one deposited elsewhere too."""
        flat = self.flat
        if flat is None or not self.entries:
            return None
        node = self.fold is not None
        batch = 1 if node else 1 + max((max(pos) for _, pos, _ in self.entries if pos), default=-1)
        if batch > len(flat.flats):
            return None
        where = {(f.data_ptr() + off * f.element_size(), pos): j
                 for pos, f in enumerate(flat.flats[:batch]) for j, off in enumerate(flat.offsets)}
        got: dict[int, list[int]] = {}
        rest = []
        for entry in self.entries:
            param, positions, partials = entry
            folded = len(partials) == 1 and len(positions) > 1
            # (tensor, flat buffer position) of each buffer the deposit wrote: a folded one writes the first only
            slots = ([(partials[0], 0)] if folded else []) if node else list(zip(partials, positions))
            js = {where.get((t.data_ptr(), pos)) for t, pos in slots}
            j = js.pop() if len(js) == 1 else None
            if j is not None and flat.params[j] is param and all(t.shape == param.shape for t, _ in slots):
                got.setdefault(j, []).extend(pos for _, pos in slots)
            else:
                rest.append(entry)
        rest_ids = {id(param) for param, _, _ in rest}
        members = sorted(got)
        if not members or any(sorted(got[j]) != list(range(batch)) or id(flat.params[j]) in rest_ids for j in members):
            return None
        return _FlatPlan(tuple(flat.params[j] for j in members), tuple(flat.offsets[j] for j in members),
                         tuple(flat.flats[:batch]), rest, node=node)


@dataclass(frozen=True)
class FlatBuffers:
    """Per-sample partial buffers for many tensors at once: ``flats[pos]`` (1-D FP32) holds the partial of
    ``params[j]`` for batch position ``pos`` at ``offsets[j]``, in the tensor's shape."""

    params: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    flats: tuple[torch.Tensor, ...]

    def view(self, j: int, pos: int) -> torch.Tensor:
        p = self.params[j]
        return self.flats[pos][self.offsets[j]:self.offsets[j] + p.numel()].view(p.shape)


@dataclass(frozen=True)
class _FlatPlan:
    params: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    flats: tuple[torch.Tensor, ...]
    rest: list[tuple[torch.Tensor, tuple[int, ...], list[torch.Tensor]]]
    node: bool = False  # flats[0] holds each tensor's fold of all the call's keys (fold mode)

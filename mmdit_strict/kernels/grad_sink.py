"""Split-invariant parameter gradients: per-sample partials folded over a fixed tree of sorted sample keys.

Autograd adds a parameter's gradient contributions in the order the backward passes run, so the
bytes of a LoRA gradient depend on how a batch was split into micro-batches. Inside a
:func:`collect_sample_grads` block, the strict GEMM backward (CPU and Triton) also hands each
sample's FP32 partial ``dZ_sᵀ X_s`` to a :class:`SampleGradSink`, keyed by the sample key the caller
declared with :func:`sample_keys` (for example ``((sample_id, step), cfg_branch)``). The fold puts the
partials at the leaves of the canonical pairwise tree over the sorted keys (:mod:`.fold_tree`) and adds
them there in FP32, so the result is the same bytes whatever the micro-batch split, sample order, CFG
layout or number of ranks (docs/design.md §3, "Gradient sink"). The leaves are the sink's keys: the
declared ones (streamed), else every key that deposited into any parameter or was marked done (stored);
a key that deposited nothing into a parameter is an empty leaf of that parameter's tree.

Two ways to hold the partials, one result:

* **stored** (``SampleGradSink()``): every (parameter, key) partial is kept until :meth:`fold`.
  Memory: one FP32 copy of every trained tensor per key. A key may deposit into a parameter more
  than once (a layer applied twice); its deposits are summed in arrival order first.
* **streamed** (``SampleGradSink(keys)``): the caller declares up front every key that will deposit
  (e.g. all (pair, branch) keys of one optimizer update). Each parameter keeps its tree's open nodes
  (at most ``⌈log2 K⌉ + 1``) and a frontier in the sorted key list; a partial whose key is at the
  frontier becomes a leaf at once, later keys wait in a buffer until every smaller key is in (or was
  declared finished with :meth:`done` without a deposit for that parameter). :func:`pending_bound`
  says how many a given execution order can buffer at most. It takes one partial per (parameter,
  key) and raises on a second one (a summed duplicate could not be placed without depending on
  timing). ``first_index`` places the keys at leaves ``first_index, first_index + 1, …`` of a larger
  tree (a rank's contiguous share of an update's keys); :meth:`nodes` then hands out the open nodes
  for the other ranks (:mod:`mmdit_strict.distributed.fold`).

Both give the same bytes: the streamed fold builds the stored fold's tree, node by node.

Many tensors, one fold: the LoRA of Qwen-Image is 1,440 tensors, and a captured backward writes all their
partials at once into flat buffers (``model/train_graphs.py``). :meth:`SampleGradSink.add_flat` takes them as
they are, and a streamed sink folds tensors that always arrive together as one group whose values are the flat
buffers: one add, copy or park for all of them where a fold per tensor launches one each. The additions are
elementwise, so each tensor's bytes are those of its own fold.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .execution import bind, current
from . import fold_tree
from .fold_tree import Node, PairwiseFold
from .fold_park import HostPark


def _host_timed(method: Callable) -> Callable:
    """Adds the host time of a public sink call (not of the calls it makes into the sink) to ``_host_s``."""

    @functools.wraps(method)
    def timed(self: "SampleGradSink", *args: Any, **kwargs: Any) -> Any:
        if self._in_call:
            return method(self, *args, **kwargs)
        self._in_call = True
        t0 = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._host_s += time.perf_counter() - t0
            self._in_call = False

    return timed


@dataclass
class _Stream:
    """One parameter's streamed fold: its tree's open nodes, frontier index into the sorted keys, buffered partials."""

    tree: PairwiseFold
    next: int = 0
    # position in the sorted keys → (owned partial, or fold of the 2^level keys from there; level)
    pending: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)
    result: torch.Tensor | None = None
    width: int = 1  # tensors one value stands for (a cohort's flat values: its members)


@dataclass(eq=False)
class _Carry:
    """A complete node of the tree (``keys``) left where a captured step wrote it (``flat``, the cohort's flat layout),
    for the next step, its right sibling, to add its own node into in place (:meth:`SampleGradSink.carry`)."""

    params: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    keys: tuple[Hashable, ...]
    flat: torch.Tensor


@dataclass(eq=False)
class _Cohort:
    """Tensors whose partials arrive together in flat buffers (:meth:`SampleGradSink.add_flat`), folded as one:
    each value of ``stream`` is a 1-D FP32 tensor holding member ``j`` at ``offsets[j]``."""

    params: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    size: int
    stream: _Stream
    finished: bool = False
    held: list[Node] | None = None  # the open nodes once :meth:`SampleGradSink.nodes` ended the fold
    taken: set[int] = field(default_factory=set)  # members whose nodes were handed out
    at: dict[int, int] = field(default_factory=dict)  # member's id → its offset

    def __post_init__(self) -> None:
        self.at = {id(p): off for p, off in zip(self.params, self.offsets)}

    def spans(self) -> list[tuple[int, int, torch.Size]]:
        return [(off, p.numel(), p.shape) for p, off in zip(self.params, self.offsets)]

    def view(self, value: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor | None:
        if value is None:
            return None
        off = self.at[id(param)]
        return value[off:off + param.numel()].view(param.shape)


@dataclass(frozen=True)
class SinkStats:
    """What a sink held at its fullest.

    Attributes:
        peak_pending: the most partials buffered at once, all parameters together (streamed; stored:
            the partials kept, which only grows).
        peak_pending_per_param: the most partials one parameter buffered at once.
        peak_pending_bytes: bytes of the buffered partials at their fullest (tree nodes not counted).
        deposits: partials received.
        peak_nodes_per_param: the most open tree nodes one parameter's streamed fold held at once
            (each one FP32 copy of the tensor; 0 for the stored fold).
        group_tensors: the most tensors folded as one group from flat deposits (:meth:`SampleGradSink.add_flat`);
            0 where every tensor was folded alone.
        host_seconds: host time spent in the sink's calls (deposits, ``done``, ``fold``, ``nodes``): on CUDA the
            launches of its copies, sums and parks, which the GPU runs later.
    """

    peak_pending: int
    peak_pending_per_param: int
    peak_pending_bytes: int
    deposits: int
    peak_nodes_per_param: int = 0
    group_tensors: int = 0
    host_seconds: float = 0.0


class SampleGradSink:
    """Per-(parameter, sample key) gradient partials and their tree fold over the sorted keys.

    Args:
        keys: ``None`` for the stored fold; else every sample key that will deposit into this sink
            (distinct, mutually comparable), for the streamed fold. A deposit under another key raises.
        first_index: streamed fold only: the leaf index of the smallest key (keys are leaves
            ``first_index .. first_index + len(keys) - 1`` of a larger tree); :meth:`fold` needs 0.
        autograd_sums: False: a backward that hands this sink a parameter's per-sample partials skips
            autograd's sum of them (the strict GEMM's summed weight-gradient product), so that parameter's
            ``.grad`` is not written; the caller takes :meth:`fold` instead. Same partials, same fold; the
            summed product's time and memory are saved.
        park: streamed fold only: where its waiting tree nodes go (:class:`~.fold_park.HostPark`: pinned host
            memory, brought back before they are joined; same bytes). None keeps them on the device.
    """

    def __init__(self, keys: Sequence[Hashable] | None = None, first_index: int = 0, *,
                 autograd_sums: bool = True, park: HostPark | None = None) -> None:
        if park is not None and keys is None:
            raise ValueError("park= moves the streamed fold's waiting nodes: it needs the streamed fold (keys=...)")
        self.autograd_sums = autograd_sums
        self.park = park
        self._params: dict[int, torch.Tensor] = {}
        self._parts: dict[int, dict[Hashable, torch.Tensor]] = {}
        self._universe: set[Hashable] = set()
        self._done: set[Hashable] = set()
        self._rank: dict[Hashable, int] | None = None
        self._order: list[Hashable] = []
        self._streams: dict[int, _Stream] = {}
        self._cohorts: dict[int, _Cohort] = {}  # member's id → its cohort
        self._finished: set[int] = set()
        self._first = first_index
        self._pending = self._pending_bytes = 0
        self._peak = self._peak_one = self._peak_bytes = self._deposits = self._peak_nodes = self._group = 0
        self._host_s, self._in_call = 0.0, False
        self._carry: _Carry | None = None
        self.carried = 0  # nodes taken by carry(), whose sibling was added into them in place or which were flushed
        if keys is None:
            if first_index:
                raise ValueError("first_index places declared keys in a larger tree: it needs the streamed fold (keys=...)")
            return
        order = sorted(keys)
        if len(set(order)) != len(order):
            dup = next(a for a, b in itertools.pairwise(order) if a == b)
            raise ValueError(f"SampleGradSink keys must be distinct; {dup!r} appears more than once")
        self._rank = {k: i for i, k in enumerate(order)}
        self._order = order

    def partial_buffers(self, param: torch.Tensor, keys: Sequence[Hashable]) -> list[torch.Tensor] | None:
        """Where a backward should write ``param``'s partials for ``keys``: None, fresh tensors (handed over)."""
        return None

    @property
    def streamed(self) -> bool:
        """True when the keys were declared up front (bounded-memory fold)."""
        return self._rank is not None

    @property
    def stats(self) -> SinkStats:
        return SinkStats(self._peak, self._peak_one, self._peak_bytes, self._deposits, self._peak_nodes, self._group,
                         self._host_s)

    @_host_timed
    def add(self, param: torch.Tensor, keys: Sequence[Hashable], partials: Sequence[torch.Tensor], *,
            transfer: bool = False) -> None:
        """Take ``partials[i]`` (the gradient of ``param`` from sample ``keys[i]`` alone) into the fold.

        By default the sink keeps no reference to a caller's tensor that it will write: a partial it
        must hold or add into is copied. ``transfer=True`` hands the tensors over (the caller allocated
        them for the sink and never touches them again), so they are held or added into without a copy.
        """
        if len(keys) != len(partials):
            raise ValueError(f"{len(keys)} sample keys for {len(partials)} gradient partials")
        self.flush_carry()
        self._check_not_done(keys)
        self._params[id(param)] = param
        self._deposits += len(keys)
        if self._rank is None:
            slot = self._parts.setdefault(id(param), {})
            for k, p in zip(keys, partials):
                self._universe.add(k)
                # a key may contribute more than once (e.g. a layer used twice); add in arrival order for that key
                if k in slot:
                    slot[k] = slot[k] + p.detach()
                else:
                    slot[k] = p.detach() if transfer else p.detach().clone()
                    self._pending += 1
                    self._pending_bytes += p.numel() * p.element_size()
            self._note(len(slot), 0)
            return
        self._put(self._own_stream(param), keys, [p.detach() for p in partials], transfer)

    def _check_not_done(self, keys: Sequence[Hashable]) -> None:
        late = [k for k in keys if k in self._done]
        if late:
            raise ValueError(f"gradient partial for sample key {late[0]!r} after the sink was told it is done")

    def _own_stream(self, param: torch.Tensor) -> _Stream:
        """Streamed: ``param``'s own fold (its group split first, if it was in one); ValueError once it was taken."""
        cohort = self._cohorts.get(id(param))
        if cohort is not None and not cohort.finished:
            self._dissolve(cohort)
        if id(param) in self._finished:
            raise ValueError("gradient partial for a parameter whose streamed fold was already taken")
        st = self._streams.get(id(param))
        if st is None:
            st = self._streams[id(param)] = _Stream(self._new_fold())
        return st

    def _new_fold(self) -> PairwiseFold:
        """A streamed fold over this sink's leaves (its keys, from ``first_index``), parking through its park."""
        return PairwiseFold(self._first, park=self.park, end=self._first + len(self._order))

    def _flat_group(self, params: Sequence[torch.Tensor], offsets: Sequence[int], keys: Sequence[Hashable],
               flats: Sequence[torch.Tensor], carried: Collection[Hashable] = ()) -> _Cohort | None:
        """The checks of a flat deposit, then the group it goes to (None: tensor by tensor). ``carried``: keys of a
        carried node this deposit completes, which were declared done while it was carried."""
        if len(params) != len(offsets):
            raise ValueError(f"{len(params)} parameters for {len(offsets)} offsets")
        self._check_not_done([k for k in keys if k not in carried])
        cohort = self._cohort_for(params, offsets, flats)
        if cohort is not None and cohort.finished:
            raise ValueError("gradient partial for a parameter whose streamed fold was already taken")
        return cohort

    @_host_timed
    def add_flat(self, params: Sequence[torch.Tensor], offsets: Sequence[int], keys: Sequence[Hashable],
                 flats: Sequence[torch.Tensor]) -> None:
        """Take, for every ``params[j]``, sample ``keys[i]``'s partial from ``flats[i][offsets[j]:][:numel]``.

        The same as ``add(params[j], keys, [that view of each flat], transfer=False)`` for each ``j``, and the same
        bytes (the fold is elementwise). A streamed sink folds tensors that always arrive together like this as one:
        every leaf, sum, copy and park is one operation on the flat buffers for all of them instead of one per
        tensor. ``flats``: 1-D FP32 tensors of one size, read only during the call (the sink copies what it holds).
        A later :meth:`add` of one of them splits the group back into one fold per tensor (views, no copy);
        :meth:`fold` or :meth:`nodes` of one of them ends the fold of the whole group.
        """
        if len(keys) != len(flats):
            raise ValueError(f"{len(keys)} sample keys for {len(flats)} flat partial buffers")
        self.flush_carry()
        cohort = self._flat_group(params, offsets, keys, flats)
        if cohort is None:
            for p, off in zip(params, offsets):
                self.add(p, keys, [f[off:off + p.numel()].view(p.shape) for f in flats])
            return
        self._deposits += len(keys) * len(params)
        self._put(cohort.stream, keys, [f.detach() for f in flats], False)

    @_host_timed
    def add_flat_node(self, params: Sequence[torch.Tensor], offsets: Sequence[int], keys: Sequence[Hashable],
                      flat: torch.Tensor) -> None:
        """Streamed: take, for every ``params[j]``, the fold of ``keys``' partials, ``flat[offsets[j]:][:numel]``:
        ``keys`` are the leaves of one complete node of the tree (:meth:`node_order`) and the value is that node's,
        their partials added pairwise in sorted-key order (a captured step that folds its own batch: the same bytes as
        :meth:`add_flat` of each key's partial). ``flat`` is read only during the call. Tensors folded as one group,
        as :meth:`add_flat`."""
        if self._rank is None:
            raise ValueError("a fold node of several keys is placed by the streamed fold only (SampleGradSink(keys))")
        carried: tuple[Hashable, ...] = ()
        if self._carry is not None and set(self._carry.keys) <= set(keys) and flat is self._carry.flat:
            carried, self._carry = self._carry.keys, None  # its sibling was added into it: this node covers both
        self.flush_carry()
        self._add_node(params, offsets, keys, flat, carried)

    def _add_node(self, params: Sequence[torch.Tensor], offsets: Sequence[int], keys: Sequence[Hashable],
                  flat: torch.Tensor, carried: Collection[Hashable] = ()) -> None:
        """:meth:`add_flat_node` once any carried node is settled (``carried``: keys of a carried node in this one,
        which may have been declared done while it was carried)."""
        self._node_of(keys)
        cohort = self._flat_group(params, offsets, keys, [flat], carried)
        if cohort is None:
            for p, off in zip(params, offsets):
                st = self._own_stream(p)
                self._params[id(p)] = p
                self._deposits += len(keys)
                self._put_node(st, keys, flat[off:off + p.numel()].view(p.shape))
            return
        self._deposits += len(keys) * len(params)
        self._put_node(cohort.stream, keys, flat.detach())

    def can_carry(self, keys: Sequence[Hashable]) -> bool:
        """Streamed: whether :meth:`carry` may take the node of ``keys`` now: nothing carried, none of ``keys`` done, and
        ``keys`` are one complete node of the tree (:meth:`node_order`) that is a left child whose sibling lies within
        this sink's keys."""
        if self._rank is None or self._carry is not None or self.node_order(keys) is None:
            return False
        if any(k in self._done for k in keys):
            return False
        start, level = self._node_of(keys)
        size = 1 << level
        return ((self._first + start) // size) % 2 == 0 and start + 2 * size <= len(self._order)

    @_host_timed
    def carry(self, params: Sequence[torch.Tensor], offsets: Sequence[int], keys: Sequence[Hashable],
              flat: torch.Tensor) -> None:
        """Streamed: take the node of ``keys`` (:meth:`can_carry`) as :meth:`add_flat_node` would, but leave it in
        ``flat`` instead of copying it into the fold: the caller's next step, whose keys are its right sibling, adds its
        own node into ``flat`` in place and hands the sum with :meth:`add_flat_node` (both nodes' keys), which is the
        parent node the fold would have made (``left + right``, elementwise FP32: the same bytes). The caller keeps
        ``flat`` unchanged until then, or calls :meth:`flush_carry` first; every other deposit, :meth:`fold` and
        :meth:`nodes` flush it (place it in the fold, copied, as :meth:`add_flat_node` does)."""
        if not self.can_carry(keys):
            raise ValueError(f"sample keys {list(keys)!r} cannot be carried: something is carried already, or they are "
                             "not a left child node of this sink's tree with its sibling among its keys")
        self._flat_group(params, offsets, keys, [flat])  # the checks of a flat deposit
        self._carry = _Carry(tuple(params), tuple(offsets), tuple(keys), flat)
        self.carried += 1

    def carried_left_of(self, keys: Sequence[Hashable], flat: torch.Tensor, params: Sequence[torch.Tensor] | None = None,
                        offsets: Sequence[int] | None = None) -> tuple[Hashable, ...] | None:
        """The carried node's keys where ``keys`` are its right sibling and ``flat`` is where it waits (and, where given,
        ``params`` at ``offsets`` are the tensors it holds); else None."""
        c = self._carry
        if c is None or flat is not c.flat or len(keys) != len(c.keys) or self._rank is None:
            return None
        if params is not None and (len(params) != len(c.params) or any(a is not b for a, b in zip(params, c.params))):
            return None
        if offsets is not None and tuple(offsets) != c.offsets:
            return None
        if any(k not in self._rank for k in keys):
            return None
        mine = sorted(self._rank[k] for k in c.keys)
        theirs = sorted(self._rank[k] for k in keys)
        return c.keys if theirs == list(range(mine[-1] + 1, mine[-1] + 1 + len(keys))) else None

    def flush_carry(self) -> None:
        """Place the carried node in the fold now (copied where it must wait), so the buffer it is in may be reused."""
        c, self._carry = self._carry, None
        if c is not None:
            self._add_node(c.params, c.offsets, c.keys, c.flat, c.keys)

    def _cohort_for(self, params: Sequence[torch.Tensor], offsets: Sequence[int],
                    flats: Sequence[torch.Tensor]) -> _Cohort | None:
        """The cohort these flat deposits continue (or start), or None to take them tensor by tensor."""
        if self._rank is None or not params:
            return None
        size = flats[0].numel() if flats else 0
        bad = [f for f in flats if f.dim() != 1 or f.dtype != torch.float32 or f.numel() != size]
        if bad:
            raise ValueError(f"flat partial buffers must be 1-D FP32 tensors of one size; got "
                             f"{[(tuple(f.shape), f.dtype) for f in flats]}")
        ends = sorted((off, off + p.numel()) for p, off in zip(params, offsets))
        if ends[0][0] < 0 or ends[-1][1] > size or any(a[1] > b[0] for a, b in itertools.pairwise(ends)):
            raise ValueError(f"the parameters' spans in the flat buffers overlap or leave them (size {size})")
        have = self._cohorts.get(id(params[0]))
        if have is not None:
            same = (len(have.params) == len(params) and all(a is b for a, b in zip(have.params, params))
                    and have.offsets == tuple(offsets) and have.size == size)
            return have if same else None
        if any(id(p) in self._streams or id(p) in self._cohorts or id(p) in self._finished for p in params):
            return None
        cohort = _Cohort(tuple(params), tuple(offsets), size,
                         _Stream(self._new_fold(), width=len(params)))
        for p in params:
            self._params[id(p)] = p
            self._cohorts[id(p)] = cohort
        self._group = max(self._group, len(params))
        return cohort

    def _dissolve(self, cohort: _Cohort) -> None:
        """Split an unfinished cohort into one streamed fold per member (views of its values, no copy)."""
        st = cohort.stream
        spans = cohort.spans()
        trees = st.tree.split(spans)
        for (off, n, shape), p, tree in zip(spans, cohort.params, trees):
            del self._cohorts[id(p)]
            pending = {r: (v[off:off + n].view(shape), level) for r, (v, level) in st.pending.items()}
            self._streams[id(p)] = _Stream(tree, st.next, pending, set(st.seen))
        for v, _ in st.pending.values():
            self._pending_bytes -= v.numel() * v.element_size() - sum(n for _, n, _ in spans) * v.element_size()

    def _put(self, st: _Stream, keys: Sequence[Hashable], values: Sequence[torch.Tensor], transfer: bool) -> None:
        """Streamed: place ``values[i]`` (key ``keys[i]``) in ``st``'s fold, or buffer it until its turn."""
        assert self._rank is not None
        fresh: dict[int, tuple[torch.Tensor, bool, int]] = {}  # position → (partial, owned by the sink, level 0)
        for k, v in zip(keys, values):
            r = self._checked_rank(st, k, fresh)
            fresh[r] = (v, transfer, 0)
        st.seen.update(fresh)
        self._advance(st, fresh, finish=False)
        self._note(len(st.pending), len(st.tree.nodes))

    def _checked_rank(self, st: _Stream, key: Hashable, fresh: dict) -> int:
        assert self._rank is not None
        r = self._rank.get(key)
        if r is None:
            raise ValueError(f"sample key {key!r} was not declared to this streamed SampleGradSink")
        if r in st.seen or r in fresh:
            raise ValueError(
                f"a second gradient partial for sample key {key!r} of one parameter: the streamed fold takes one "
                "partial per (parameter, key); use the stored fold (SampleGradSink() without keys) when a layer "
                "runs more than once per sample")
        return r

    def _put_node(self, st: _Stream, keys: Sequence[Hashable], value: torch.Tensor) -> None:
        """Streamed: place the fold of ``keys``' partials (one complete node of the tree, :meth:`node_order`) in ``st``'s
        fold, or buffer it until its turn (copied then)."""
        ranks: dict[int, tuple] = {}
        for k in keys:
            ranks[self._checked_rank(st, k, ranks)] = ()
        start, level = self._node_of(keys)
        st.seen.update(ranks)
        self._advance(st, {start: (value, False, level)}, finish=False)
        self._note(len(st.pending), len(st.tree.nodes))

    def node_order(self, keys: Sequence[Hashable]) -> tuple[int, ...] | None:
        """Streamed: where ``keys`` (a forward's sample keys, in batch order) are the leaves of one complete node of this
        sink's tree — ``2^l >= 2`` keys next to each other in the sorted order, the first at a leaf index that is a
        multiple of ``2^l`` — the batch positions in sorted-key order (the order the node folds them in); else None."""
        if self._rank is None or len(keys) < 2 or len(keys) & (len(keys) - 1) or len(set(keys)) != len(keys):
            return None
        ranks = [self._rank.get(k) for k in keys]
        if any(r is None for r in ranks):
            return None
        order = sorted(range(len(keys)), key=lambda i: ranks[i])
        lo = ranks[order[0]]
        if ranks[order[-1]] - lo != len(keys) - 1 or (self._first + lo) % len(keys):
            return None
        return tuple(order)

    def _node_of(self, keys: Sequence[Hashable]) -> tuple[int, int]:
        """(first position, level) of the complete node whose leaves are ``keys``; ValueError if they are none."""
        if self.node_order(keys) is None:
            raise ValueError(f"sample keys {list(keys)!r} are not the leaves of one complete node of this sink's tree "
                             "(2^l consecutive keys in sorted order from a leaf index that is a multiple of 2^l)")
        assert self._rank is not None
        return min(self._rank[k] for k in keys), len(keys).bit_length() - 1

    @_host_timed
    def done(self, keys: Sequence[Hashable]) -> None:
        """Declare that ``keys`` will deposit no more partials (their micro-batch's backward has run).

        A later deposit under one of them raises. Stored: the keys become leaves of every
        parameter's tree (empty where they deposited nothing). Streamed: every parameter's fold moves
        past those keys where they deposited nothing into it.
        """
        if self._rank is not None:
            unknown = [k for k in keys if k not in self._rank]
            if unknown:
                raise ValueError(f"sample key {unknown[0]!r} was not declared to this streamed SampleGradSink")
        else:
            self._universe.update(keys)
        self._done.update(keys)
        if self._rank is not None:
            for pid, st in self._streams.items():
                if pid not in self._finished:
                    self._advance(st, {}, finish=False)
            for cohort in {id(c): c for c in self._cohorts.values()}.values():
                if not cohort.finished:
                    self._advance(cohort.stream, {}, finish=False)

    def params(self) -> list[torch.Tensor]:
        return list(self._params.values())

    @_host_timed
    def fold(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s partials folded over the key tree (FP32), or None if it got none.

        Stored: a new tensor each call. Streamed: the first call adds what is still buffered (every
        key counts as done for this parameter from then on) and returns the root; later calls
        return the same tensor.
        """
        if self._rank is None:
            slot = self._parts.get(id(param))
            if not slot:
                return None
            return fold_tree.fold(slot.get(k) for k in sorted(self._universe))
        self.flush_carry()
        if self._first:
            raise ValueError(f"this sink's keys start at leaf {self._first}: take its nodes() and merge them with "
                             "the other ranges' (mmdit_strict.distributed.fold)")
        cohort = self._cohorts.get(id(param))
        if cohort is not None:
            if not cohort.finished:
                self._finish_cohort(cohort)
                cohort.stream.result = cohort.stream.tree.result()
            return cohort.view(cohort.stream.result, param)
        st = self._streams.get(id(param))
        if st is None:
            return None
        if id(param) not in self._finished:
            self._finish(st, id(param))
            st.result = st.tree.result()
        return st.result

    @_host_timed
    def nodes(self, param: torch.Tensor) -> list[Node] | None:
        """Streamed fold: ``param``'s open tree nodes once every key is in (the range's reduced form), or None if
        it got no partial. Ends this parameter's fold (a later deposit raises); the nodes are the sink's, handed over."""
        if self._rank is None:
            raise ValueError("tree nodes of a key range are kept only by the streamed fold (SampleGradSink(keys))")
        self.flush_carry()
        cohort = self._cohorts.get(id(param))
        if cohort is not None:
            if id(param) in cohort.taken:
                raise ValueError("nodes() was already taken for this parameter")
            if not cohort.finished:
                self._finish_cohort(cohort)
                cohort.held = cohort.stream.tree.held()
            if cohort.held is None:
                raise ValueError("nodes() of a parameter whose fold() was taken")
            cohort.taken.add(id(param))
            return [Node(n.level, n.start, cohort.view(n.value, param), True) for n in cohort.held]
        st = self._streams.get(id(param))
        if st is None:
            return None
        if id(param) in self._finished:
            raise ValueError("nodes() was already taken for this parameter")
        self._finish(st, id(param))
        return st.tree.held()

    def partials(self, param: torch.Tensor) -> dict[Hashable, torch.Tensor]:
        """Stored fold only: ``param``'s partial per sample key, as held (not copies); empty if it got none.

        Lets a caller move the partials elsewhere (another process) and fold them there.
        """
        if self._rank is not None:
            raise ValueError("per-key partials are kept only by the stored fold (SampleGradSink() without keys)")
        return dict(self._parts.get(id(param), {}))

    # ------------------------------------------------------------------ streamed fold internals
    def _finish(self, st: _Stream, pid: int) -> None:
        self._advance(st, {}, finish=True)
        self._finished.add(pid)

    def _finish_cohort(self, cohort: _Cohort) -> None:
        self._advance(cohort.stream, {}, finish=True)
        cohort.finished = True
        self._finished.update(id(p) for p in cohort.params)

    def _advance(self, st: _Stream, fresh: dict[int, tuple[torch.Tensor, bool, int]], finish: bool) -> None:
        """Put every partial (or node: ``level`` > 0) at the frontier into the tree (an empty leaf for a key done
        without a deposit here); buffer what is still out of order (copied unless the sink owns it)."""
        while st.next < len(self._order):
            r = st.next
            if r in fresh:
                part, owned, level = fresh.pop(r)
                # copied at settle() below only if it still waits when this call ends
                st.tree.push(Node(level, st.tree.next, part, owned), settle=False)
            elif r in st.pending:
                part, level = self._unbuffer(st, r)
                st.tree.push(Node(level, st.tree.next, part, True))
            elif finish or (self._order[r] in self._done
                            and (self._carry is None or self._order[r] not in self._carry.keys)):
                level = 0
                st.tree.leaf(None)
            else:
                break
            st.next += 1 << level
        st.tree.settle()
        for r, (p, owned, level) in fresh.items():
            st.pending[r] = (p if owned else p.clone(), level)
            self._pending += st.width
            self._pending_bytes += p.numel() * p.element_size()

    def _unbuffer(self, st: _Stream, r: int) -> tuple[torch.Tensor, int]:
        p, level = st.pending.pop(r)
        self._pending -= st.width
        self._pending_bytes -= p.numel() * p.element_size()
        return p, level

    def _note(self, per_param: int, nodes: int) -> None:
        self._peak = max(self._peak, self._pending)
        self._peak_one = max(self._peak_one, per_param)
        self._peak_bytes = max(self._peak_bytes, self._pending_bytes)
        self._peak_nodes = max(self._peak_nodes, nodes)


def pending_bound(batches: Sequence[Sequence[Hashable]]) -> int:
    """The most partials one parameter's streamed fold can buffer when ``batches`` run in this order.

    Each batch's keys arrive during its backward and are marked done after it. Before batch ``j``,
    every key of batches ``0..j-1`` is in, so the frontier stands at ``f``, the smallest key not among
    them; while batch ``j`` runs, only keys of batches ``0..j`` above ``f`` can wait. The bound is the
    largest such count; it is ``len(batch) - 1`` at most when each batch holds consecutive keys of the
    sorted order and the batches run in order.
    """
    every = sorted(k for b in batches for k in b)
    seen: set[Hashable] = set()
    frontier = 0
    worst = 0
    for b in batches:
        f = every[frontier] if frontier < len(every) else None
        seen.update(b)
        if f is not None:
            worst = max(worst, sum(1 for k in seen if k > f))
        while frontier < len(every) and every[frontier] in seen:
            frontier += 1
    return worst


def execution_order(batches: Sequence[Sequence[Hashable]]) -> list[int]:
    """Indices of ``batches`` by their smallest key: each batch run next holds the frontier key.

    The composition of the batches is left as it is; only the order they run in changes, which does
    not change a sink's fold but lowers what a streamed fold buffers (:func:`pending_bound`).
    """
    return sorted(range(len(batches)), key=lambda i: min(batches[i]))


@contextlib.contextmanager
def collect_sample_grads(sink: SampleGradSink | None = None) -> Iterator[SampleGradSink]:
    """Forward and backward passes inside the block deposit per-sample partials into ``sink`` (a new stored
    one by default): the ``grad_sink`` field of the execution context."""
    active_sink = sink if sink is not None else SampleGradSink()
    with bind(current().replace(grad_sink=active_sink)):
        yield active_sink


@contextlib.contextmanager
def sample_keys(keys: Sequence[Hashable]) -> Iterator[None]:
    """Declare the sample key of each sample of the forward(s) run inside the block, in batch order
    (the ``sample_keys`` field of the execution context)."""
    with bind(current().replace(sample_keys=tuple(keys))):
        yield


def active() -> tuple[SampleGradSink | None, tuple[Hashable, ...] | None]:
    """The sink and sample keys in force (read by the GEMM autograd functions at forward time, which hold
    them for their backward)."""
    ctx = current()
    return ctx.grad_sink, ctx.sample_keys

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
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .execution import bind, current
from . import fold_tree
from .fold_tree import Node, PairwiseFold
from .fold_park import HostPark


@dataclass
class _Stream:
    """One parameter's streamed fold: its tree's open nodes, frontier index into the sorted keys, buffered partials."""

    tree: PairwiseFold
    next: int = 0
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # position in the sorted keys → owned partial
    seen: set[int] = field(default_factory=set)
    result: torch.Tensor | None = None


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
    """

    peak_pending: int
    peak_pending_per_param: int
    peak_pending_bytes: int
    deposits: int
    peak_nodes_per_param: int = 0


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
        self._finished: set[int] = set()
        self._first = first_index
        self._pending = self._pending_bytes = 0
        self._peak = self._peak_one = self._peak_bytes = self._deposits = self._peak_nodes = 0
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
        return SinkStats(self._peak, self._peak_one, self._peak_bytes, self._deposits, self._peak_nodes)

    def add(self, param: torch.Tensor, keys: Sequence[Hashable], partials: Sequence[torch.Tensor], *,
            transfer: bool = False) -> None:
        """Take ``partials[i]`` (the gradient of ``param`` from sample ``keys[i]`` alone) into the fold.

        By default the sink keeps no reference to a caller's tensor that it will write: a partial it
        must hold or add into is copied. ``transfer=True`` hands the tensors over (the caller allocated
        them for the sink and never touches them again), so they are held or added into without a copy.
        """
        if len(keys) != len(partials):
            raise ValueError(f"{len(keys)} sample keys for {len(partials)} gradient partials")
        late = [k for k in keys if k in self._done]
        if late:
            raise ValueError(f"gradient partial for sample key {late[0]!r} after the sink was told it is done")
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
        if id(param) in self._finished:
            raise ValueError("gradient partial for a parameter whose streamed fold was already taken")
        st = self._streams.get(id(param))
        if st is None:
            st = self._streams[id(param)] = _Stream(PairwiseFold(self._first, park=self.park))
        fresh: dict[int, tuple[torch.Tensor, bool]] = {}  # position → (partial, owned by the sink)
        for k, p in zip(keys, partials):
            r = self._rank.get(k)
            if r is None:
                raise ValueError(f"sample key {k!r} was not declared to this streamed SampleGradSink")
            if r in st.seen:
                raise ValueError(
                    f"a second gradient partial for sample key {k!r} of one parameter: the streamed fold takes one "
                    "partial per (parameter, key); use the stored fold (SampleGradSink() without keys) when a layer "
                    "runs more than once per sample")
            st.seen.add(r)
            fresh[r] = (p.detach(), transfer)
        self._advance(st, fresh, finish=False)
        self._note(len(st.pending), len(st.tree.nodes))

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

    def params(self) -> list[torch.Tensor]:
        return list(self._params.values())

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
        if self._first:
            raise ValueError(f"this sink's keys start at leaf {self._first}: take its nodes() and merge them with "
                             "the other ranges' (mmdit_strict.distributed.fold)")
        st = self._streams.get(id(param))
        if st is None:
            return None
        if id(param) not in self._finished:
            self._finish(st, id(param))
            st.result = st.tree.result()
        return st.result

    def nodes(self, param: torch.Tensor) -> list[Node] | None:
        """Streamed fold: ``param``'s open tree nodes once every key is in (the range's reduced form), or None if
        it got no partial. Ends this parameter's fold (a later deposit raises); the nodes are the sink's, handed over."""
        if self._rank is None:
            raise ValueError("tree nodes of a key range are kept only by the streamed fold (SampleGradSink(keys))")
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

    def _advance(self, st: _Stream, fresh: dict[int, tuple[torch.Tensor, bool]], finish: bool) -> None:
        """Put every partial at the frontier into the tree (an empty leaf for a key done without a deposit
        here); buffer what is still out of order (copied unless the sink owns it)."""
        while st.next < len(self._order):
            r = st.next
            if r in fresh:
                part, owned = fresh.pop(r)
                st.tree.leaf(part, owned)
            elif r in st.pending:
                st.tree.leaf(self._unbuffer(st, r), True)
            elif finish or self._order[r] in self._done:
                st.tree.leaf(None)
            else:
                break
            st.next += 1
        for r, (p, owned) in fresh.items():
            st.pending[r] = p if owned else p.clone()
            self._pending += 1
            self._pending_bytes += p.numel() * p.element_size()

    def _unbuffer(self, st: _Stream, r: int) -> torch.Tensor:
        p = st.pending.pop(r)
        self._pending -= 1
        self._pending_bytes -= p.numel() * p.element_size()
        return p

    def _note(self, per_param: int, nodes: int) -> None:
        self._peak = max(self._peak, self._pending)
        self._peak_one = max(self._peak_one, per_param)
        self._peak_bytes = max(self._peak_bytes, self._pending_bytes)
        self._peak_nodes = max(self._peak_nodes, nodes)


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
    """

    def __init__(self, autograd_sums: bool = True,
                 buffers: Callable[[torch.Tensor, int, int], torch.Tensor | None] | None = None) -> None:
        self.autograd_sums = autograd_sums  # as the real sink's (SampleGradSink): read by the captured backward
        self.buffers = buffers
        self._uses: dict[tuple[int, int], int] = {}
        self.entries: list[tuple[torch.Tensor, tuple[int, ...], list[torch.Tensor]]] = []

    def partial_buffers(self, param: torch.Tensor, keys: Sequence[int]) -> list[torch.Tensor] | None:
        """The buffers ``buffers`` gives for ``param`` at batch positions ``keys`` (None unless it gives them all)."""
        if self.buffers is None:
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
        self.entries.append((param, tuple(keys), [p.detach() for p in partials]))

    def clear(self) -> None:
        self.entries.clear()
        self._uses.clear()

    def replay(self, sink: SampleGradSink, keys: Sequence[Hashable]) -> None:
        """Deposit every recorded partial into ``sink`` under ``keys[position]``, in the recorded order."""
        for param, positions, partials in self.entries:
            sink.add(param, [keys[i] for i in positions], partials, transfer=False)


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

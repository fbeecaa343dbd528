"""CUDA-graph replay of the strict training step: the forward with autograd and its backward, per batch layout.

A LoRA forward + backward with gradient checkpointing launches tens of thousands of small kernels;
launched one by one from Python the GPU waits on the host (``docs/design.md`` §8). Here the forward
(with checkpointing, saving what autograd saves) and the backward (checkpoint recomputes, every
gradient product, the per-sample partials for the grad sink) are captured once per layout as two
graphs sharing one memory pool, and a training forward replays them through one autograd node:

* forward: copy the inputs into the graph's static buffers, replay the forward graph, return a copy
  of its output (a node whose backward is the backward graph);
* backward: copy the output gradient into the static buffer, replay the backward graph, return the
  parameters' gradients (added into ``.grad`` as autograd accumulates the uncaptured ones),
  and hand the grad sink in force at the forward the per-sample partials the replay wrote
  (:class:`~mmdit_strict.kernels.grad_sink.DepositLog`, under that call's sample keys). The partials
  are written into buffers every captured step of the cache shares (:class:`PartialArena`), not into
  each step's own pool.

The kernels and their arguments are those of the uncaptured step, so the bytes are too (tested on the
GPU: ``tests/model/test_train_graphs.py``, ``tests/training/test_gpu_training.py``). A graph's activations live in its pool until its
backward has run, so a layout whose forward runs again before the first one's backward (the two
forwards of the sequential CFG layout) gets a second captured instance; one that is never
backpropagated frees its instance when autograd drops the node. Instances are never live together
unless their forwards run back to back like that, so they share pools by group: an instance is captured
into the pool of a group with no instance between its forward and its backward, and replays only while
its group has none. The sequential CFG layout's two forwards then take two groups and every other step
reuses their pools, instead of one pool per instance.

The parameters' gradients reach ``.grad`` (and the sink), not ``torch.autograd.grad(loss, params)``, which
needs ``enable_cuda_graphs(training=False)``; hooks on the parameters' gradient accumulation do not run.

Used where it is safe, else the uncaptured step runs: CUDA, a strict or auto runtime, no operator
capture / fault / overlay, no sharded model-parallel layout, inputs that need no gradient, and
trainable parameters (the LoRA) that keep their storage — an optimizer step updates them in place and
the replay reads them; attaching another adapter makes a new key.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..kernels.execution import current, using
from ..kernels.deposit_log import DepositLog, FlatBuffers
from ..kernels.grad_sink import SampleGradSink
from ..kernels.keepalive import retaining
from ..kernels.trace import OperatorTrace, active_trace, capture_trace
from .graphs import load_inputs, static_inputs

if TYPE_CHECKING:
    from .mmdit import ModelInputs


#: Each tensor's partial starts at a multiple of this many elements of a flat buffer (256 bytes in FP32), so its
#: view is as aligned as a buffer of its own for the kernels that write it.
FLAT_ALIGN = 64
#: The arena's buffers are views of one flat buffer per batch position, which the grad sink folds for all tensors at
#: once. False: a buffer of its own per tensor and position, handed to the sink tensor by tensor (same bytes; a CPU
#: test compares the two folds), for isolating the flat path when a GPU result is in doubt.
FLAT_PARTIALS = True


class PartialArena:
    """The FP32 buffers every captured backward of one cache writes its per-sample gradient partials into.

    A captured backward's partials are one FP32 copy of every trained tensor per sample (about 1.7 GB at
    Qwen-Image size with Flow-GRPO's rank-64 LoRA). They are read once, when the replay hands them to the grad
    sink, so the captured steps need not each hold their own: buffers are reserved per (parameter, batch
    position, occurrence) after a capture's warm-up and shared. Before a backward replay writes them, its stream
    waits for an event recorded after the sink's reads of the previous replay's partials.

    The trained tensors' first partials at each batch position are views of one flat buffer per position
    (:class:`~mmdit_strict.kernels.deposit_log.FlatBuffers`, zero-filled, each view at a multiple of
    :data:`FLAT_ALIGN`), so a streamed sink takes a replay's partials with a few operations on those buffers
    instead of one per tensor (``SampleGradSink.add_flat``).
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[int, int, int], torch.Tensor] = {}
        self._flat: FlatBuffers | None = None
        self._read: torch.cuda.Event | None = None
        self._cuda = False

    def __len__(self) -> int:
        return len(self._bufs)

    def nbytes(self) -> int:
        own = sum(b.numel() * b.element_size() for b in self._bufs.values() if not self._in_flat(b))
        flat = sum(f.numel() * f.element_size() for f in self._flat.flats) if self._flat is not None else 0
        return own + flat

    def _in_flat(self, buf: torch.Tensor) -> bool:
        return self._flat is not None and any(buf.untyped_storage().data_ptr() == f.untyped_storage().data_ptr()
                                              for f in self._flat.flats)

    def _ensure(self, key: tuple[int, int, int], shape: torch.Size, dtype: torch.dtype, device: torch.device) -> None:
        """A buffer of this shape, dtype and device under ``key`` (kept if it has them, else a new one)."""
        have = self._bufs.get(key)
        if have is None or have.shape != shape or have.dtype != dtype or have.device != device:
            self._bufs[key] = torch.empty(shape, dtype=dtype, device=device)
        self._cuda = self._cuda or device.type == "cuda"

    def flat(self, params: list[torch.Tensor], batch: int) -> FlatBuffers | None:
        """The flat buffers of ``params`` for batch positions ``0 .. batch-1`` (made or widened as needed; the
        tensors' buffers at occurrence 0 become their views). None without parameters or across devices."""
        if not params or len({p.device for p in params}) != 1:
            return None
        offsets, size = [], 0
        for p in params:
            offsets.append(size)
            size += -(-p.numel() // FLAT_ALIGN) * FLAT_ALIGN
        have = self._flat
        if have is None or len(have.params) != len(params) or any(a is not b for a, b in zip(have.params, params)):
            have = FlatBuffers(tuple(params), tuple(offsets), ())
        if len(have.flats) < batch:
            extra = tuple(torch.zeros(size, dtype=torch.float32, device=params[0].device)
                          for _ in range(batch - len(have.flats)))
            have = FlatBuffers(have.params, have.offsets, have.flats + extra)
        self._flat = have
        for pos in range(len(have.flats)):
            for j, p in enumerate(params):
                self._bufs[id(p), pos, 0] = have.view(j, pos)
        self._cuda = self._cuda or params[0].device.type == "cuda"
        return have

    def attach(self, log: DepositLog, params: list[torch.Tensor], batch: int) -> None:
        """Point a capture's deposit log at this arena: a buffer for every trained tensor at every position (views
        of the flat buffers; a short warm-up deposits for two blocks only), plus one for each deposit the warm-up's
        log shows beyond that (a layer used twice)."""
        positions = 1 if log.fold is not None else batch  # a folding backward writes one node per tensor
        log.flat = self.flat(params, positions) if FLAT_PARTIALS else None
        if log.flat is None:
            for p in params:
                for pos in range(positions):
                    self._ensure((id(p), pos, 0), p.shape, torch.float32, p.device)
        self.reserve(log.entries)
        log.buffers = self.buffer

    def reserve(self, entries: list[tuple[torch.Tensor, tuple[int, ...], list[torch.Tensor]]]) -> None:
        """Buffers for the deposits of a :class:`DepositLog` (``entries``, in arrival order) that have none yet."""
        uses: dict[tuple[int, int], int] = {}
        for param, positions, partials in entries:
            for pos, part in zip(positions, partials, strict=True):
                n = uses.get((id(param), pos), 0)
                uses[id(param), pos] = n + 1
                self._ensure((id(param), pos, n), part.shape, part.dtype, part.device)

    def buffer(self, param: torch.Tensor, position: int, occurrence: int) -> torch.Tensor | None:
        """The buffer for this deposit (:class:`DepositLog`'s ``buffers``), or None if none was reserved."""
        buf = self._bufs.get((id(param), position, occurrence))
        return buf if buf is not None and buf.shape == param.shape else None

    def before_write(self) -> None:
        """Order a backward replay after the reads of the last partials handed to a sink."""
        if self._read is not None:
            torch.cuda.current_stream().wait_event(self._read)

    def after_read(self) -> None:
        """Mark the point on the current stream where the sink's reads of the partials are queued."""
        if self._cuda:
            self._read = torch.cuda.Event()
            self._read.record()


class _Lease:
    """Held by an autograd node between a replayed forward and its backward: while it lives, the instance's
    activations belong to that node."""


@dataclass(eq=False)
class _Instance:
    forward: torch.cuda.CUDAGraph
    backward: torch.cuda.CUDAGraph
    inputs: "ModelInputs"  # static input buffers
    out: torch.Tensor
    grad_out: torch.Tensor
    grads: tuple[torch.Tensor | None, ...]
    deposits: DepositLog | None
    trace: OperatorTrace  # operators of one forward + backward (checkpoint recomputes included)
    tables: list[Any]  # cached device tables the graphs read
    arena: PartialArena | None = None  # where the backward writes the partials (shared with the cache's other steps)
    group: int = 0  # instances of one group share a memory pool; at most one of them is busy at a time
    lease: Any = field(default=None)  # weakref to the _Lease of the node using the activations, or None

    def busy(self) -> bool:
        return self.lease is not None and self.lease() is not None


def add_into_grads(params: list[torch.Tensor], grads: tuple[torch.Tensor | None, ...]) -> None:
    """``p.grad += g`` for each pair, ``p.grad = copy of g`` where ``p.grad`` is None (a None ``g`` is skipped):
    what autograd's accumulation does, in a few multi-tensor launches instead of one per parameter (the
    default LoRA on 60 blocks has 1,200 tensors). Each element is one add (or copy) as before, so the bytes are those
    of ``p.grad.add_(g)`` / ``g.clone()``."""
    into: list[torch.Tensor] = []
    added: list[torch.Tensor] = []
    fresh: list[tuple[torch.Tensor, torch.Tensor]] = []
    for p, g in zip(params, grads, strict=True):
        if g is None:
            continue
        if p.grad is None:
            fresh.append((p, g))
        else:
            into.append(p.grad)
            added.append(g)
    if into:
        torch._foreach_add_(into, added)
    if fresh:
        copies = [torch.empty_like(g) for _, g in fresh]
        torch._foreach_copy_(copies, [g for _, g in fresh])
        for (p, _), c in zip(fresh, copies):
            p.grad = c


class _Replay(torch.autograd.Function):
    """One captured training forward as an autograd node whose backward replays the backward graph.

    The node's only differentiable input is an empty ``anchor``; the backward adds the parameters'
    gradients into ``.grad`` itself, as autograd's accumulation would (set where None, else added in
    place). Were the parameters the node's inputs, their accumulation nodes would live on the stream of
    this replay while a second instance is captured on the capture stream, and autograd's stream
    synchronisation between the two invalidates that capture (the sequential CFG layout)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, inst: _Instance, sink: Any, keys: tuple | None,  # type: ignore[override]
                params: list[torch.Tensor]) -> torch.Tensor:
        inst.forward.replay()
        lease = _Lease()
        inst.lease = weakref.ref(lease)
        ctx.lease, ctx.inst, ctx.sink, ctx.keys, ctx.params = lease, inst, sink, keys, params
        return inst.out.clone()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        if ctx.lease is None:
            raise RuntimeError("a captured training step cannot be backpropagated twice (retain_graph); "
                               "disable training graphs (model.enable_cuda_graphs(training=False)) for that")
        inst = ctx.inst
        inst.grad_out.copy_(grad_out)
        if ctx.sink is not None:  # a node the sink carries in the shared buffer: added into, or placed first
            inst.deposits.before_replay(ctx.sink, ctx.keys)
        if inst.arena is not None:
            inst.arena.before_write()
        inst.backward.replay()
        with torch.no_grad():
            add_into_grads(ctx.params, inst.grads)
        if ctx.sink is not None:
            inst.deposits.replay(ctx.sink, ctx.keys)
        if inst.arena is not None:
            inst.arena.after_read()
        ctx.lease = None
        return None, None, None, None, None


def pick_group(busy: set[int], made: int, share: bool) -> int:
    """The pool group a new instance is captured into: the lowest of groups ``0 .. made-1`` with no busy instance,
    else a new one, ``made`` (``share`` False: always the new one, i.e. a pool per instance)."""
    if share:
        free = next((g for g in range(made) if g not in busy), None)
        if free is not None:
            return free
    return made


class TrainGraphCache:
    """Captured training steps keyed by batch layout, trainable parameters and grad-sink use (with or without
    autograd's sums of the deposited gradients: ``SampleGradSink(autograd_sums=...)``).

    ``max_instances`` bounds the captured instances (pairs of graphs) over every key; the least recently
    used idle one goes first, and a call that finds no instance of its key it may replay and no room runs
    uncaptured. ``share_pools``: instances share memory pools by group (module docstring); False gives each
    its own pool. ``fold_batches``: a call under a streamed sink whose sample keys are the leaves of one node of
    the sink's tree (``SampleGradSink.node_order``: e.g. both CFG branches of a pair, in the batched layout) gets an
    instance whose backward folds its batch's partials into that node inside the graph, so it writes one partial
    buffer per tensor instead of one per tensor and sample, and the sink takes one node; same bytes. Off here;
    ``train`` sets it from ``train.fold_captured_batches`` (on by default). ``carry`` (with ``fold_batches``): such an
    instance's backward can add its node into the shared buffer's content instead of overwriting it (a device flag set
    before each replay), so a node that is a left child waits there for its sibling's step (``SampleGradSink.carry``)
    instead of being copied out; same bytes; ``train.carry_fold_nodes``. :meth:`clear` releases them all
    (needed after swapping parameters' storage, e.g. ``load_state_dict(assign=True)``).
    """

    def __init__(self, max_instances: int = 4, share_pools: bool = True, fold_batches: bool = False,
                 carry: bool = False) -> None:
        self.max_instances = max_instances
        self.share_pools = share_pools
        self.fold_batches = fold_batches
        self.carry = carry
        self._entries: OrderedDict[tuple, list[_Instance]] = OrderedDict()
        self.captures = 0
        self.replays = 0
        self.uncaptured = 0
        self._anchors: dict[torch.device, torch.Tensor] = {}  # the replay node's one differentiable input
        self._arena = PartialArena()

    def clear(self) -> None:
        self._entries.clear()
        self._arena = PartialArena()  # an instance still leased keeps the buffers it writes through its log

    def _anchor(self, device: torch.device) -> torch.Tensor:
        if device not in self._anchors:
            self._anchors[device] = torch.empty(0, device=device, requires_grad=True)
        return self._anchors[device]

    def __len__(self) -> int:
        return sum(len(v) for v in self._entries.values())

    def run(self, inputs: "ModelInputs", runtime: object, params: list[torch.Tensor],
            forward: Callable[["ModelInputs"], torch.Tensor], layout_key: tuple,
            warmup: Callable[["ModelInputs"], torch.Tensor] | None = None) -> torch.Tensor | None:
        """``forward(inputs)`` with autograd through captured graphs, or None where none can serve this call
        (the caller then runs it uncaptured). A capture is warmed up with ``warmup`` (default ``forward``)."""
        ctx = current()
        sink, keys = ctx.grad_sink, ctx.sample_keys
        batch = inputs.hidden_states.shape[0]
        with_sink = sink is not None and keys is not None
        if with_sink and len(keys) != batch:
            raise ValueError(f"sample_keys declares {len(keys)} samples but this forward has {batch}")
        sums = sink.autograd_sums if with_sink else True  # False: the captured backward leaves the sums out
        # a call whose keys are one node of the sink's tree may fold its batch in the graph (DepositLog(fold=...))
        fold = sink.node_order(keys) if with_sink and self.fold_batches and isinstance(sink, SampleGradSink) else None
        carry = fold is not None and self.carry
        key = (layout_key, with_sink, sums, tuple(id(p) for p in params), fold, carry)
        held = self._entries.get(key)
        busy = self.busy_groups()
        inst = next((i for i in held if i.group not in busy), None) if held else None
        if inst is None:
            if not self._make_room():
                self.uncaptured += 1
                return None
            group = pick_group(busy, 1 + max((i.group for i in self._instances()), default=-1), self.share_pools)
            # the pool of an instance of the group still held (none left: the allocator frees the group's pool and
            # the capture makes a new one)
            pool = next((i.forward.pool() for i in self._instances() if i.group == group), None)
            inst = self._capture(inputs, params, forward, with_sink, sums, self._arena, warmup, pool, fold, carry)
            inst.group = group
            self._entries.setdefault(key, []).append(inst)
            self.captures += 1
        self._entries.move_to_end(key)
        load_inputs(inst.inputs, inputs)
        out = _Replay.apply(self._anchor(inputs.hidden_states.device), inst, sink if with_sink else None,
                            tuple(keys) if with_sink else None, params)
        self.replays += 1
        outer = active_trace()
        if outer is not None:  # a replay runs the operators recorded at capture: count them again
            outer.merge(inst.trace)
        return out

    def _instances(self) -> list[_Instance]:
        return [i for held in self._entries.values() for i in held]

    def busy_groups(self) -> set[int]:
        """The groups with an instance between its forward and its backward replay."""
        return {i.group for i in self._instances() if i.busy()}

    def pools(self) -> int:
        """Memory pools the captured instances hold."""
        return len({i.group for i in self._instances()})

    def arena_bytes(self) -> int:
        """Bytes of the shared per-sample partial buffers."""
        return self._arena.nbytes()

    def _make_room(self) -> bool:
        """Drop idle instances, least recently used first, until one more fits; False if every one is busy."""
        while len(self) >= self.max_instances:
            for key, held in self._entries.items():
                idle = next((i for i in held if not i.busy()), None)
                if idle is not None:
                    held.remove(idle)
                    if not held:
                        del self._entries[key]
                    break
            else:
                return False
        return True

    @staticmethod
    def _capture(inputs: "ModelInputs", params: list[torch.Tensor], forward: Callable[["ModelInputs"], torch.Tensor],
                 with_sink: bool, sums: bool = True, arena: PartialArena | None = None,
                 warmup: Callable[["ModelInputs"], torch.Tensor] | None = None, pool: tuple | None = None,
                 fold: tuple[int, ...] | None = None, carry: bool = False) -> _Instance:
        static = static_inputs(inputs)
        log = DepositLog(autograd_sums=sums, fold=fold) if with_sink else None
        positions = tuple(range(inputs.hidden_states.shape[0])) if with_sink else None
        bound = current().replace(grad_sink=log, sample_keys=positions)
        with using(bound):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), capture_trace():  # warm-up: compiles kernels, fills every per-layout cache
                out = (warmup or forward)(static)
                torch.autograd.grad(out, params, torch.zeros_like(out), allow_unused=True)
                del out
            torch.cuda.current_stream().wait_stream(stream)
            if log is not None:
                if arena is not None:  # the partials go to the shared buffers, not into this step's pool
                    arena.attach(log, params, inputs.hidden_states.shape[0])
                    if carry and log.flat is not None:  # read by the folded deposits at every replay
                        log.accumulate = torch.zeros((), dtype=torch.bool, device=inputs.hidden_states.device)
                log.clear()
            fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with retaining(every_thread=True) as tables, capture_trace() as trace:
                with torch.cuda.graph(fwd, pool=pool):
                    out = forward(static)
                grad_out = torch.empty_like(out)
                with torch.cuda.graph(bwd, pool=fwd.pool()):
                    grads = torch.autograd.grad(out, params, grad_out, allow_unused=True)
        return _Instance(fwd, bwd, static, out.detach(), grad_out, tuple(grads), log, trace, tables,
                         arena if log is not None and log.buffers is not None else None)

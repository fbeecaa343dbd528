"""Host parking of the fold nodes that wait: the streamed gradient fold's memory off the GPU, the same bytes.

A streamed fold (:class:`~.fold_tree.PairwiseFold`) holds up to ``⌈log2 K⌉ + 1`` open nodes per trained tensor;
with Flow-GRPO's rank-64 LoRA on Qwen-Image each node of every tensor together is an FP32 copy of the whole
adapter (1.6 GiB), so an update over 64 keys can hold 5 or 6 of them. Only the top of the stack is written
while leaves arrive: a node covered by a newer one waits until the newer subtree has grown to its size. While
it waits it is *parked*: copied to pinned host memory on a side stream, its GPU block freed (a node that joins
within ``lookahead`` leaves stays). The parked node joined first is copied back ``lookahead`` leaves early, so
the copy overlaps the next micro-batch's compute; the ones below it, which join right after it in the same
cascade, join from the host: each is added into its sibling (which the fold owns) in chunks copied through two
small device buffers, so it never has a device copy (the joining stream waits for each chunk's copy; a node whose
sibling the fold does not own, or is empty, is copied back whole). Bringing them all back early would put every
tensor's nodes on the device together before an update's last joins: the peak parking removes.

A sum made by a join that the next node pushed would cover and park is parked at once (where the fold knows where
its leaves end: ``PairwiseFold(end=...)``, as the grad sink builds it), so it is off the device while the next
micro-batch computes, e.g. while a new layout's training step is captured.

Parked values live in host buffers (:class:`HostBuffers`) that outlive the park: ``train`` keeps them from one
update to the next, since pinning gigabytes is slow.

A copy moves bytes unchanged, so a parked fold's result equals the unparked one's bit for bit. On the CPU
"parking" is a copy into another tensor: the bookkeeping runs and is tested, nothing is saved.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .fold_tree import Node


@dataclass
class ParkedNode(Node):
    """A node whose ``value`` is a host copy; ``back`` is its device copy once prefetched."""

    device: torch.device | None = None
    back: torch.Tensor | None = None
    back_ready: Any = None  # CUDA event: ``back`` is complete
    buffer: torch.Tensor | None = None  # the pool's whole host buffer ``value`` views (None: not the pool's)


class HostBuffers:
    """Host buffers for parked nodes (pinned where the nodes come from a GPU), handed out again once every copy that
    read them has finished: pinning gigabytes takes the host a quarter of a second per park, about the whole
    host time of parking, so ``train`` keeps one of these across its updates. Buffers are kept by (elements, dtype),
    and the pool only grows (to the most nodes parked at once)."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype, bool], list[tuple[torch.Tensor, Any]]] = {}
        self.allocated = 0  # buffers made
        self.reused = 0  # buffers handed out again

    def take(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """A 1-D host buffer of ``numel`` elements: a free one whose last reader has finished, else a new one."""
        free = self._free.get((numel, dtype, pinned), [])
        for i, (buf, read) in enumerate(free):
            if read is None or read.query():
                del free[i]
                self.reused += 1
                return buf
        self.allocated += 1
        return torch.empty(numel, dtype=dtype, pin_memory=pinned)

    def give(self, buf: torch.Tensor, read: Any = None) -> None:
        """Return ``buf``; ``read``: a CUDA event recorded after the last copy that reads it (None: nothing pending)."""
        self._free.setdefault((buf.numel(), buf.dtype, buf.is_pinned()), []).append((buf, read))


@dataclass
class ParkStats:
    """What a park moved (nodes parked and brought back, bytes on the host at once at the most) and the host time
    its calls took: ``host_alloc_s`` in the host buffers' allocations (pinned on CUDA), ``park_s`` in :meth:`HostPark.park`
    (those allocations included), ``back_s`` in starting and awaiting copies back (:meth:`HostPark.prefetch`,
    :meth:`HostPark.fetch`). On CUDA they are launch and bookkeeping times: the copies run later, on a side stream."""

    parks: int = 0
    fetches: int = 0
    prefetched: int = 0  # fetches whose copy was issued before the node was needed
    peak_host_bytes: int = 0
    added_from_host: int = 0  # parked nodes joined by adding them into their sibling in chunks (no device copy)
    host_alloc_s: float = 0.0
    park_s: float = 0.0
    back_s: float = 0.0


class HostPark:
    """Parks waiting fold nodes in (pinned) host memory and brings them back; see the module docstring.

    Args:
        lookahead: leaves before a parked node's join at which its copy back is issued (at least the keys one
            micro-batch deposits, so the copy runs during the next micro-batch).
    """

    #: bytes of one chunk of :meth:`add_into` (two such device buffers per device, kept for the park's life)
    CHUNK_BYTES = 32 << 20

    def __init__(self, lookahead: int = 8, buffers: HostBuffers | None = None) -> None:
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0 leaves, got {lookahead}")
        self.lookahead = lookahead
        self.stats = ParkStats()
        self._host_bytes = 0
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._staging: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        self.buffers = HostBuffers() if buffers is None else buffers

    @classmethod
    def for_micro_batches(cls, keys: Sequence[Sequence[Any]], lookahead: int | None = None,
                          buffers: HostBuffers | None = None) -> "HostPark":
        """The park ``train`` uses for an update of these micro-batches' keys: by default a node's copy back starts one
        micro-batch's keys before its join, so it overlaps that micro-batch's compute; ``lookahead`` (keys) instead
        (0: each node comes back at its join, the fewest nodes on the device). ``buffers``: host buffers kept from
        earlier updates."""
        return cls(lookahead=max(map(len, keys)) if lookahead is None else lookahead, buffers=buffers)

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def park(self, node: Node) -> Node:
        """``node`` with its value moved to the host (as it is if empty or already parked)."""
        v = node.value
        if v is None or isinstance(node, ParkedNode):
            return node
        t0 = time.perf_counter()
        buf = self.buffers.take(v.numel(), v.dtype, pinned=v.is_cuda)
        host = buf.view(v.shape)
        self.stats.host_alloc_s += time.perf_counter() - t0
        if v.is_cuda:
            side = self._side(v.device)
            side.wait_stream(torch.cuda.current_stream(v.device))
            with torch.cuda.stream(side):
                host.copy_(v, non_blocking=True)
            v.record_stream(side)  # its block is reused only after the copy has read it
        else:
            host.copy_(v)
        self.stats.park_s += time.perf_counter() - t0
        self.stats.parks += 1
        self._host_bytes += host.numel() * host.element_size()
        self.stats.peak_host_bytes = max(self.stats.peak_host_bytes, self._host_bytes)
        return ParkedNode(node.level, node.start, host, True, v.device, buffer=buf)

    def _returned(self, node: ParkedNode, read: Any, t0: float) -> None:
        """Book a parked node as back on its device (copied back or added into its sibling; the call began at ``t0``)
        and hand its host buffer to the pool once read (``read``: the event after the last copy that reads it)."""
        if node.buffer is not None:
            self.buffers.give(node.buffer, read)
            node.buffer = None
        assert node.value is not None
        self.stats.fetches += 1
        self._host_bytes -= node.value.numel() * node.value.element_size()
        self.stats.back_s += time.perf_counter() - t0

    @staticmethod
    def holds(node: Node) -> bool:
        """Whether ``node`` is one of this park's (parked, or on its way back)."""
        return isinstance(node, ParkedNode)

    def split(self, node: Node, spans: Sequence[tuple[int, int, torch.Size]]) -> list[Node]:
        """A parked node of a flat (1-D) value as one parked node per ``(offset, numel, shape)`` span (views of its
        host copy and, if its copy back has started, of that copy, which they wait for as the whole did). The bytes
        no span covers stop counting as parked."""
        assert isinstance(node, ParkedNode) and node.value is not None
        pieces: list[Node] = []
        kept = 0
        for off, n, shape in spans:
            back = None if node.back is None else node.back[off:off + n].view(shape)
            pieces.append(ParkedNode(node.level, node.start, node.value[off:off + n].view(shape), True, node.device,
                                     back, node.back_ready))  # views: the whole buffer is not handed back
            kept += n * node.value.element_size()
        self._host_bytes -= node.value.numel() * node.value.element_size() - kept
        return pieces

    @staticmethod
    def parked(node: Node) -> bool:
        """Whether ``node`` waits on the host (its copy back not started yet)."""
        return isinstance(node, ParkedNode) and node.back is None

    @staticmethod
    def returning(node: Node) -> bool:
        """Whether ``node`` is a parked node whose copy back has started."""
        return isinstance(node, ParkedNode) and node.back is not None

    def prefetch(self, node: Node) -> None:
        """Start copying a parked node back to its device (nothing for any other node, or if already started)."""
        if self.parked(node):
            t0 = time.perf_counter()
            self._copy_back(node)  # type: ignore[arg-type]
            self.stats.prefetched += 1
            self.stats.back_s += time.perf_counter() - t0

    def _copy_back(self, node: ParkedNode) -> None:
        host = node.value
        assert host is not None and node.device is not None
        if node.device.type == "cuda":
            side = self._side(node.device)
            with torch.cuda.stream(side):  # after the copy out, which was queued on this stream too
                node.back = torch.empty(host.shape, dtype=host.dtype, device=node.device)
                node.back.copy_(host, non_blocking=True)
                node.back_ready = torch.cuda.Event()
                node.back_ready.record(side)
        else:
            node.back = host.clone()

    def add_into(self, node: Node, dst: torch.Tensor) -> torch.Tensor:
        """``dst += `` a parked node's value, read from the host in chunks: the join of a parked node with a sibling
        the fold owns, without the node's device copy (only two chunk buffers on the device). ``dst + value`` has
        the bytes of ``value + dst`` (:func:`~.fold_tree._join`). The current stream waits for each chunk's copy."""
        assert self.parked(node) and node.value is not None
        host = node.value
        if host.shape != dst.shape or host.dtype != dst.dtype:
            raise ValueError(f"a parked node of {tuple(host.shape)} {host.dtype} joins {tuple(dst.shape)} {dst.dtype}")
        t0 = time.perf_counter()
        if dst.is_cuda and dst.is_contiguous():
            src, out = host.reshape(-1), dst.view(-1)
            step = max(1, self.CHUNK_BYTES // src.element_size())
            bufs = self._chunk_buffers(dst.device, dst.dtype, min(step, src.numel()))
            side, cur = self._side(dst.device), torch.cuda.current_stream(dst.device)
            side.wait_stream(cur)  # the chunk buffers were last read by adds queued on ``cur``
            read: list[Any] = [None, None]
            for i, off in enumerate(range(0, src.numel(), step)):
                n = min(step, src.numel() - off)
                buf = bufs[i % 2][:n]
                with torch.cuda.stream(side):
                    if read[i % 2] is not None:
                        side.wait_event(read[i % 2])  # the add two chunks back has read this buffer
                    buf.copy_(src[off:off + n], non_blocking=True)
                    copied = torch.cuda.Event()
                    copied.record(side)
                cur.wait_event(copied)
                out[off:off + n].add_(buf)
                read[i % 2] = torch.cuda.Event()
                read[i % 2].record(cur)
            read_by = copied
        else:
            dst.add_(host.to(dst.device))
            read_by = None
        self.stats.added_from_host += 1
        self._returned(node, read_by, t0)  # type: ignore[arg-type]
        return dst

    def _chunk_buffers(self, device: torch.device, dtype: torch.dtype, numel: int) -> list[torch.Tensor]:
        have = self._staging.get((device, dtype))
        if have is None or have[0].numel() < numel:
            have = self._staging[(device, dtype)] = [torch.empty(numel, dtype=dtype, device=device) for _ in range(2)]
        return have

    def fetch(self, node: Node) -> Node:
        """``node`` on its device again, owned by the fold (any other node as it is)."""
        if not isinstance(node, ParkedNode):
            return node
        t0 = time.perf_counter()
        if node.back is None:
            self._copy_back(node)
        back = node.back
        assert back is not None and node.value is not None
        if back.is_cuda:
            stream = torch.cuda.current_stream(back.device)
            stream.wait_event(node.back_ready)
            back.record_stream(stream)  # made on the side stream, used and freed on this one
        self._returned(node, node.back_ready if back.is_cuda else None, t0)
        return Node(node.level, node.start, back, True)

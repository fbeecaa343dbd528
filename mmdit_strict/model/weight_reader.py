"""Read checkpoint tensors into their final tensors, several at a time, through bounded staging buffers.

Each worker thread pulls a job (one large tensor, or a run of small tensors lying next to each other in
one file) and reads its bytes with positional reads (``os.preadv``, which leaves the GIL), so reads of
several tensors overlap with each other and with the copies:

* CUDA target: bytes go from the page cache into one of the worker's two pinned staging buffers, then
  to the GPU with an asynchronous copy on the worker's own stream; the next read fills the other buffer
  while that copy runs. A tensor stored in another dtype lands in a temporary of its stored dtype on the
  GPU and is cast there, once. Host memory beyond the model: ``workers × 2 × chunk_bytes`` pinned bytes.
* CPU target: bytes are read straight into the parameter when the dtypes agree; otherwise into a small
  host buffer, chunk by chunk, each chunk cast into its slice of the parameter.

Every tensor is checked finite in its stored dtype (``aminmax``: NaN and ±Inf reach the extremes), on the
GPU for a CUDA target, with one host synchronisation for the whole load. The values are the stored ones,
cast once with ``Tensor.copy_`` (round to nearest even), whatever the number of workers.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from .safetensors_layout import LayoutError, TensorSpan

#: Pinned staging per buffer for a CUDA target (two buffers per worker).
CUDA_CHUNK_BYTES = 32 * 2**20
#: Host staging per worker when a CPU load casts (a dtype-matching CPU load reads into the parameters).
HOST_CHUNK_BYTES = 4 * 2**20
_ALIGN = 64  # chunk boundaries stay whole elements of every dtype


@dataclass
class ReadResult:
    """The loaded tensors by name, and the names of tensors holding NaN or ±Inf (sorted)."""

    tensors: dict[str, torch.Tensor]
    nonfinite: list[str] = field(default_factory=list)


def default_workers(device: torch.device) -> int:
    """Reader threads: up to 8 for a CUDA target (reads overlap copies), up to 4 on the host; never more than cores."""
    return max(1, min(8 if device.type == "cuda" else 4, os.cpu_count() or 1))


def plan_jobs(spans: Sequence[TensorSpan], chunk_bytes: int) -> list[list[TensorSpan]]:
    """Group spans into jobs: file order kept, consecutive small spans of one file together while the run
    stays within ``chunk_bytes`` (one read), every span of ``chunk_bytes`` or more on its own."""
    jobs: list[list[TensorSpan]] = []
    run: list[TensorSpan] = []
    for s in sorted(spans, key=lambda s: (str(s.file), s.offset)):
        if run and (s.file != run[0].file or s.offset + s.nbytes - run[0].offset > chunk_bytes):
            jobs.append(run)
            run = []
        if s.nbytes >= chunk_bytes:
            jobs.append([s])
        else:
            run.append(s)
    if run:
        jobs.append(run)
    return jobs


def _pread(fd: int, buf: memoryview, offset: int, path: Path) -> None:
    """Fill ``buf`` from ``offset`` of the open file; a short file raises :class:`LayoutError` naming it."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise LayoutError(f"{path} ended at byte {offset + done} inside a tensor that runs to {offset + len(buf)}",
                              path)
        done += n


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as flat ``uint8``."""
    return t.reshape(-1).view(torch.uint8)


def _finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on ``t``'s device: no NaN, no ±Inf (no host synchronisation)."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    if t.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        return torch.isfinite(torch.stack(torch.aminmax(t.reshape(-1)))).all()
    return torch.isfinite(t).all()


class _HostSink:
    """A worker's CPU-target reads: straight into the parameter, or through one small buffer when casting."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk = chunk_bytes
        self.stage: torch.Tensor | None = None
        self.flags: list[tuple[str, torch.Tensor]] = []

    def run(self, fds: dict[Path, int], job: list[TensorSpan], dests: dict[str, torch.Tensor]) -> None:
        for s in job:
            dest = dests[s.key]
            if s.nbytes == 0:
                continue
            if s.dtype == dest.dtype:
                _pread(fds[s.file], memoryview(_bytes(dest).numpy()), s.offset, s.file)
                self.flags.append((s.key, _finite(dest)))
                continue
            if self.stage is None:
                self.stage = torch.empty(self.chunk, dtype=torch.uint8)
            flat, ok = dest.reshape(-1), torch.ones((), dtype=torch.bool)
            for start in range(0, s.nbytes, self.chunk):
                n = min(self.chunk, s.nbytes - start)
                _pread(fds[s.file], memoryview(self.stage.numpy())[:n], s.offset + start, s.file)
                piece = self.stage[:n].view(s.dtype)
                ok &= _finite(piece)
                i = start // s.dtype.itemsize
                flat[i:i + piece.numel()].copy_(piece)
            self.flags.append((s.key, ok))

    def close(self) -> None:
        self.stage = None


class _CudaSink:
    """A worker's CUDA-target reads: two pinned buffers, one stream; a read fills one buffer while the
    other's copy to the GPU runs."""

    def __init__(self, device: torch.device, chunk_bytes: int, after: torch.cuda.Stream) -> None:
        self.device = device
        self.chunk = chunk_bytes
        self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(after)  # the caller's stream allocated the destinations
        self.slots = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.views = [memoryview(s.numpy()) for s in self.slots]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.flags: list[tuple[str, torch.Tensor]] = []

    def _slot(self) -> int:
        """The next staging buffer, once the copy that last read it has finished."""
        i, self.turn = self.turn, self.turn ^ 1
        ev = self.events[i]
        if ev is not None:
            ev.synchronize()
        return i

    def _landing(self, s: TensorSpan, dest: torch.Tensor) -> torch.Tensor:
        """Where the stored bytes go on the GPU: the parameter itself, or a temporary in the stored dtype."""
        if s.dtype == dest.dtype:
            return dest
        with torch.cuda.stream(self.stream):
            return torch.empty(s.shape, dtype=s.dtype, device=self.device)

    def _finish(self, s: TensorSpan, landed: torch.Tensor, dest: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            self.flags.append((s.key, _finite(landed)))
            if landed is not dest:
                dest.copy_(landed)  # the one cast, on the GPU

    def run(self, fds: dict[Path, int], job: list[TensorSpan], dests: dict[str, torch.Tensor]) -> None:
        job = [s for s in job if s.nbytes]
        if not job:
            return
        if len(job) == 1 and job[0].nbytes > self.chunk:
            self._large(fds[job[0].file], job[0], dests[job[0].key])
            return
        first, last = job[0], job[-1]
        length = last.offset + last.nbytes - first.offset
        i = self._slot()
        _pread(fds[first.file], self.views[i][:length], first.offset, first.file)
        landed = []
        with torch.cuda.stream(self.stream):
            for s in job:
                dst = self._landing(s, dests[s.key])
                a = s.offset - first.offset
                _bytes(dst).copy_(self.slots[i][a:a + s.nbytes], non_blocking=True)
                landed.append(dst)
            self.events[i] = self.stream.record_event()
        for s, dst in zip(job, landed):
            self._finish(s, dst, dests[s.key])

    def _large(self, fd: int, s: TensorSpan, dest: torch.Tensor) -> None:
        landed = self._landing(s, dest)
        raw = _bytes(landed)
        for start in range(0, s.nbytes, self.chunk):
            n = min(self.chunk, s.nbytes - start)
            i = self._slot()
            _pread(fd, self.views[i][:n], s.offset + start, s.file)
            with torch.cuda.stream(self.stream):
                raw[start:start + n].copy_(self.slots[i][:n], non_blocking=True)
                self.events[i] = self.stream.record_event()
        self._finish(s, landed, dest)

    def close(self) -> None:
        self.stream.synchronize()  # every copy and cast of this worker has finished
        self.slots, self.views = [], []


def read_tensors(
    spans: Sequence[TensorSpan], device: torch.device, dtype: torch.dtype, *, workers: int | None = None,
    chunk_bytes: int | None = None,
) -> ReadResult:
    """Read every span into a new tensor of ``dtype`` on ``device`` (named by the span's key).

    ``workers`` reader threads (default :func:`default_workers`) share the jobs of :func:`plan_jobs`;
    ``chunk_bytes`` is the staging size (defaults :data:`CUDA_CHUNK_BYTES`, :data:`HOST_CHUNK_BYTES`). The
    bytes do not depend on either. Returns when every tensor is in place on the device. A file shorter
    than its header says raises :class:`LayoutError`; an unreadable one, ``OSError``.
    """
    cuda = device.type == "cuda"
    if cuda and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    chunk = chunk_bytes or (CUDA_CHUNK_BYTES if cuda else HOST_CHUNK_BYTES)
    chunk = max(_ALIGN, chunk // _ALIGN * _ALIGN)  # the jobs and the sinks' buffers agree on one size
    jobs = plan_jobs(spans, chunk)
    workers = max(1, min(workers or default_workers(device), len(jobs) or 1))
    dests = {s.key: torch.empty(s.shape, dtype=dtype, device=device) for s in spans}
    caller = torch.cuda.current_stream(device) if cuda else None
    files = sorted({s.file for s in spans}, key=str)
    fds: dict[Path, int] = {}
    pending: Iterator[list[TensorSpan]] = iter(jobs)
    lock, failed = threading.Lock(), threading.Event()

    def work() -> list[tuple[str, torch.Tensor]]:
        sink: _CudaSink | _HostSink | None = None
        try:
            sink = _CudaSink(device, chunk, caller) if cuda else _HostSink(chunk)
            while not failed.is_set():
                with lock:
                    job = next(pending, None)
                if job is None:
                    break
                sink.run(fds, job, dests)
        except BaseException:
            failed.set()  # the other workers stop at their next job
            raise
        finally:
            if sink is not None:
                sink.close()
        return sink.flags

    try:
        for f in files:
            fds[f] = os.open(f, os.O_RDONLY)
        if workers == 1:
            flags = work()
        else:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weight-reader") as pool:
                futures = [pool.submit(work) for _ in range(workers)]
                flags = [x for fut in futures for x in fut.result()]
    finally:
        for fd in fds.values():
            os.close(fd)
    ok = torch.stack([f for _, f in flags]).cpu() if flags else torch.ones(0, dtype=torch.bool)  # the one sync
    nonfinite = sorted(k for (k, _), good in zip(flags, ok.tolist()) if not good)
    if cuda:
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            empty()  # hand the staging buffers' pinned pages back
    return ReadResult(dests, nonfinite)

"""The process group of a ``torchrun`` launch: detection, start and stop, and checked exchanges.

A process is distributed when ``torchrun`` started it (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` and
``MASTER_ADDR`` are all set); otherwise nothing here does anything and no process group exists.

Every exchange is a collective that all ranks enter in the same order. Values that must stay
byte-exact only move (all_gather_object, gather_object, broadcast_object_list of whole tensors,
staged on the host); nothing is ever reduced. Each exchange first all-gathers a small status record
``(label, error)``: when a rank failed, or the ranks are at different labels (out of step), every rank
learns it from the same gathered list and stops with :class:`PeerFailed` (exit 2) instead of waiting.
Every collective is bounded by the group's timeout (``distributed.timeout_s``), so a rank that died
without a word ends the others with an error, never a hang.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import socket
import time
from datetime import timedelta
from typing import Any, Callable, Iterator, TypeVar

import torch

from ..context import bound

T = TypeVar("T")

#: What torchrun sets in every worker; all four mean "this process is one rank of a group".
TORCHRUN_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")


class PeerFailed(RuntimeError):
    """Another rank failed, died or is out of step; this rank stops too."""


@dataclasses.dataclass
class Session:
    """This process's place in the group."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    timeout_s: float
    broken: bool = False  # a collective failed or a peer reported a failure: no further collectives
    traffic: Traffic = dataclasses.field(default_factory=lambda: Traffic())
    #: called when the session ends, before the process group goes: release what was built on it (subgroups)
    on_close: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    @property
    def root(self) -> bool:
        return self.rank == 0


@dataclasses.dataclass
class Traffic:
    """What this rank's exchanges cost so far: wall time inside collectives (status records included) and the
    tensor bytes it put in (``bytes_out``) and got from other ranks (``bytes_in``), pickle framing left out."""

    seconds: float = 0.0
    bytes_out: int = 0
    bytes_in: int = 0
    calls: int = 0

    def snapshot(self) -> "Traffic":
        return dataclasses.replace(self)

    def since(self, before: "Traffic") -> "Traffic":
        return Traffic(self.seconds - before.seconds, self.bytes_out - before.bytes_out,
                       self.bytes_in - before.bytes_in, self.calls - before.calls)


def payload_bytes(obj: Any) -> int:
    """Bytes of every tensor in ``obj`` (dicts, lists, tuples, dataclass-free containers)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    return 0


def traffic() -> Traffic | None:
    """This rank's exchange totals (None in a single process)."""
    s = current()
    return None if s is None else s.traffic


_SESSION: contextvars.ContextVar[Session | None] = contextvars.ContextVar("mmdit_distributed_session", default=None)


def launched() -> bool:
    """True when ``torchrun`` started this process (its environment variables are all set)."""
    return all(k in os.environ for k in TORCHRUN_ENV)


def current() -> Session | None:
    """The active session; None in a single process."""
    return _SESSION.get()


def is_root() -> bool:
    """True on rank 0, and in a single process."""
    s = current()
    return s is None or s.root


def tag() -> str:
    """``"[rank r/W] "`` inside a session, ``""`` otherwise (a prefix for error lines)."""
    s = current()
    return "" if s is None else f"[rank {s.rank}/{s.world_size}] "


def resolve_backend(backend: str, device: str) -> str:
    """``auto`` → ``nccl`` for a CUDA model, ``gloo`` otherwise; explicit names are kept."""
    if backend == "auto":
        return "nccl" if str(device).startswith("cuda") else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"distributed.backend must be auto, gloo or nccl, got {backend!r}")
    return backend


@contextlib.contextmanager
def session(timeout_s: float, backend: str = "auto", device: str = "cpu") -> Iterator[Session]:
    """Join the group torchrun set up (rendezvous from its environment) and leave it on exit.

    With a CUDA model each rank uses GPU ``LOCAL_RANK % device_count`` (several ranks may share one
    GPU with the gloo backend, which stages every exchanged tensor through host memory).
    """
    import torch.distributed as dist

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    name = resolve_backend(backend, device)
    if str(device).startswith("cuda") and torch.cuda.is_available():
        torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group(name, timeout=timedelta(seconds=float(timeout_s)))
    s = Session(rank, world, local, name, float(timeout_s))
    try:
        with bound(_SESSION, s):
            yield s
    finally:
        for release in reversed(s.on_close):
            with contextlib.suppress(Exception):
                release()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def host(obj: Any) -> Any:
    """``obj`` with every tensor (in dicts, lists, tuples) detached and copied to the host: what is pickled and sent."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host(v) for v in obj)
    return obj


def _collective(s: Session, label: str, fn: Callable[[], T], sent: int = 0, received: Callable[[], int] | None = None) -> T:
    t0 = time.perf_counter()
    try:
        out = fn()
        s.traffic.seconds += time.perf_counter() - t0
        s.traffic.calls += 1
        s.traffic.bytes_out += sent
        if received is not None:
            s.traffic.bytes_in += received()
        return out
    except Exception as exc:
        s.broken = True
        raise PeerFailed(f"lost contact with the other ranks during {label!r} "
                         f"(a rank died or exceeded distributed.timeout_s={s.timeout_s:g}): {' '.join(str(exc).split())[:300]}") from exc


def _status(s: Session, label: str, error: BaseException | None) -> None:
    """All-gather ``(label, error)``; raise :class:`PeerFailed` when another rank failed or is elsewhere.

    A rank that itself failed (``error`` given) returns after telling the others; its caller re-raises.
    """
    import torch.distributed as dist

    mine = {"label": label, "rc": None,
            "error": None if error is None else f"{type(error).__name__}: {' '.join(str(error).split())}"[:500]}
    got: list[Any] = [None] * s.world_size
    _collective(s, label, lambda: dist.all_gather_object(got, mine))
    problems = []
    for r, entry in enumerate(got):
        if r == s.rank:
            continue
        if entry["label"] == "exit":
            problems.append(f"rank {r} has already stopped (exit code {entry['rc']})")
        elif entry["error"] is not None:
            problems.append(f"rank {r} failed at {entry['label']!r}: {entry['error']}")
        elif entry["label"] != label:
            problems.append(f"rank {r} is at {entry['label']!r}, not {label!r} (out of step)")
    if any(e["label"] != label for e in got):
        s.broken = True  # a rank left the protocol or is out of step: no further collectives
    if problems and error is None:
        raise PeerFailed("; ".join(problems))


@contextlib.contextmanager
def stage(label: str) -> Iterator[None]:
    """Run the block; then every rank says whether its block succeeded, and all stop if one failed.

    Outside a session the block just runs.
    """
    s = current()
    if s is None:
        yield
        return
    try:
        yield
    except Exception as exc:
        if not s.broken and not isinstance(exc, PeerFailed):
            _status(s, label, exc)
        raise
    _status(s, label, None)


def from_root(label: str, fn: Callable[[], T]) -> T:
    """``fn()`` run on rank 0 alone and its result moved (pickled, tensors on the host) to every rank."""
    import torch.distributed as dist

    s = current()
    if s is None:
        return fn()
    value: Any = None
    with stage(label):
        if s.root:
            value = host(fn())
    box = [value]
    sent = payload_bytes(value) * (s.world_size - 1) if s.root else 0
    _collective(s, label, lambda: dist.broadcast_object_list(box, src=0), sent,
                (lambda: 0) if s.root else (lambda: payload_bytes(box[0])))
    return box[0]


def gather_to_root(label: str, payload: Any) -> list[Any] | None:
    """Every rank's ``payload`` (tensors on the host), in rank order, on rank 0; None on the other ranks.

    Preceded by a status exchange under ``label`` (the caller computed ``payload`` successfully).
    """
    import torch.distributed as dist

    s = current()
    if s is None:
        return [payload]
    _status(s, label, None)
    out: list[Any] | None = [None] * s.world_size if s.root else None
    data = host(payload)
    _collective(s, label, lambda: dist.gather_object(data, out, dst=0), 0 if s.root else payload_bytes(data),
                lambda: sum(payload_bytes(o) for r, o in enumerate(out) if r != s.rank) if out is not None else 0)
    return out


def all_gather(label: str, payload: Any) -> list[Any]:
    """Every rank's ``payload`` in rank order, on every rank (after a status exchange under ``label``)."""
    import torch.distributed as dist

    s = current()
    if s is None:
        return [payload]
    _status(s, label, None)
    out: list[Any] = [None] * s.world_size
    data = host(payload)
    _collective(s, label, lambda: dist.all_gather_object(out, data), payload_bytes(data),
                lambda: sum(payload_bytes(o) for r, o in enumerate(out) if r != s.rank))
    return out


def send(label: str, payload: Any, dst: int) -> None:
    """Move ``payload`` (tensors on the host) to rank ``dst``, which calls :func:`receive` with this rank as ``src``."""
    import torch.distributed as dist

    s = _require_session()
    data = host(payload)
    _collective(s, label, lambda: dist.send_object_list([data], dst=dst), payload_bytes(data))


def receive(label: str, src: int) -> Any:
    """What rank ``src`` :func:`send` to this rank."""
    import torch.distributed as dist

    s = _require_session()
    box: list[Any] = [None]
    _collective(s, label, lambda: dist.recv_object_list(box, src=src), 0, lambda: payload_bytes(box[0]))
    return box[0]


def _wire(s: Session, t: torch.Tensor) -> torch.Tensor:
    """``t`` as the backend moves it: on its GPU for nccl, in host memory for gloo (a CUDA tensor is staged)."""
    return t.contiguous() if s.backend == "nccl" else t.detach().cpu().contiguous()


def send_tensor(label: str, t: torch.Tensor, dst: int) -> None:
    """Move the whole tensor ``t`` to rank ``dst`` (which calls :func:`recv_tensor` with its size and dtype)."""
    import torch.distributed as dist

    s = _require_session()
    wire = _wire(s, t)
    _collective(s, label, lambda: dist.send(wire, dst=dst), wire.numel() * wire.element_size())


def recv_tensor(label: str, numel: int, dtype: torch.dtype, device: torch.device | str, src: int) -> torch.Tensor:
    """The tensor rank ``src`` sent with :func:`send_tensor` (flat, ``numel`` elements), on ``device``."""
    import torch.distributed as dist

    s = _require_session()
    where = torch.device(device) if s.backend == "nccl" else torch.device("cpu")
    buf = torch.empty(numel, dtype=dtype, device=where)
    _collective(s, label, lambda: dist.recv(buf, src=src), 0, lambda: buf.numel() * buf.element_size())
    return buf.to(device)


def broadcast_tensor(label: str, t: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Rank 0's flat tensor ``t`` (``numel`` elements) on every rank, on ``device``; moved whole, never reduced."""
    import torch.distributed as dist

    s = _require_session()
    where = torch.device(device) if s.backend == "nccl" else torch.device("cpu")
    buf = _wire(s, t) if s.root and t is not None else torch.empty(numel, dtype=dtype, device=where)
    _collective(s, label, lambda: dist.broadcast(buf, src=0), buf.numel() * buf.element_size() * (s.world_size - 1) if s.root else 0,
                (lambda: 0) if s.root else (lambda: buf.numel() * buf.element_size()))
    return buf.to(device)


def status(label: str) -> None:
    """Every rank says it reached ``label`` without error; raises :class:`PeerFailed` when one did not."""
    s = current()
    if s is not None:
        _status(s, label, None)


def _require_session() -> Session:
    s = current()
    if s is None:
        raise RuntimeError("point-to-point exchanges need a torchrun session")
    return s


def finish(rc: int) -> int:
    """The job's exit code, the same on every rank: 2 when any rank ended with 2, else rank 0's code.

    Skipped (this rank's own code, at least 2) when the group is already broken: the others learnt it
    in the same exchange and are leaving too.
    """
    import sys

    import torch.distributed as dist

    s = current()
    if s is None:
        return rc
    sys.stdout.flush()
    sys.stderr.flush()
    if s.broken:
        return max(rc, 2)
    got: list[Any] = [None] * s.world_size
    try:
        mine = {"label": "exit", "rc": rc, "error": None, "pid": os.getpid(), "host": socket.gethostname()}
        _collective(s, "exit", lambda: dist.all_gather_object(got, mine))
    except PeerFailed:
        return 2
    if any(g["label"] != "exit" for g in got):
        s.broken = True  # those ranks see this one's exit record and stop
        return 2
    codes = [int(g["rc"]) for g in got]
    if not s.root and got[0]["host"] == socket.gethostname():
        _wait_for_exit(int(got[0]["pid"]), s.timeout_s)
    return 2 if 2 in codes else codes[0]


def _wait_for_exit(pid: int, limit_s: float) -> None:
    """Wait (at most ``limit_s``) until process ``pid`` has ended.

    torchrun stops every worker as soon as one exits non-zero; rank 0, which prints the result and
    writes the report, therefore leaves first, and the other ranks follow (or are stopped by torchrun).
    """
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            return
        time.sleep(0.05)

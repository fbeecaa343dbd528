"""Output folders a run may write into, and the lock that keeps two runs out of one folder.

A run writes into ``output_dir`` only when the folder

* does not exist yet (it is created), or is empty, or
* holds the marker file ``.mmdit-strict-run`` that an earlier command of the same kind wrote there.

Any other folder (the user's ``configs/``, the current folder, a home directory) is refused, so a
run never overwrites files it did not write. The marker records the kind of command that owns the
folder: ``run`` (the trajectory commands: ``run``, ``rollout``, ``sample``, ``recompute``, ``report``),
``train`` or ``ablate`` (whose jobs are ``run`` folders inside it). A command of another kind refuses
the folder, so ``run`` never overwrites a training run's ``config.yaml``. Readers (``report``) only claim a folder that already holds a marker of their
kind and never write one.

While a command works in the folder it holds an exclusive ``flock`` on ``.mmdit-strict.lock``,
which also records the holder's pid, host and start time. A second command into the same folder
fails at once naming that pid. The kernel drops the lock when the holder exits however it dies
(``kill -9`` included), so a lock file left behind by a killed run never blocks the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from ..io import atomic_write_text

MARKER = ".mmdit-strict-run"
LOCK = ".mmdit-strict.lock"


#: Folder kinds a marker may record, and the commands that make each.
KINDS = {"run": "run, rollout, sample or recompute", "train": "train", "ablate": "ablate"}


class OutputDirError(ValueError):
    """The output folder cannot be used: not a folder, foreign files, another command's folder, or in use."""


def _legacy_kind(out: Path) -> str:
    """The owner of a folder marked before markers recorded a kind: training leaves checkpoints behind."""
    return "train" if (out / "checkpoints").is_dir() or (out / "metrics.jsonl").is_file() else "run"


def marker_kind(out: Path) -> str | None:
    """The kind recorded in ``out``'s marker; None without a marker. A marker that cannot be read is an error."""
    path = out / MARKER
    if not path.exists():
        return None
    try:
        info = json.loads(path.read_text())
        kind = info["kind"] if "kind" in info else _legacy_kind(out)
    except (OSError, ValueError, AttributeError) as exc:
        raise OutputDirError(f"{path} is damaged ({exc}); this folder's owner cannot be told: pick another folder") from None
    if kind not in KINDS:
        raise OutputDirError(f"{path} records an unknown kind {kind!r} (known: {', '.join(KINDS)})")
    return kind


def check_output_dir(path: str | Path, *, kind: str = "run", existing_run: bool = False) -> Path:
    """Raise :class:`OutputDirError` unless a command of ``kind`` may write into ``path``; return it as a ``Path``.

    ``existing_run=True`` (for ``report``) asks for an existing folder that a command of ``kind`` made.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown output folder kind {kind!r} (known: {', '.join(KINDS)})")
    if not str(path).strip():
        raise OutputDirError("output_dir must name a folder, got an empty string")
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"output_dir={out} exists and is not a folder")
    if existing_run and not out.is_dir():
        raise OutputDirError(f"{out} is not a folder")
    owner = marker_kind(out) if out.is_dir() else None
    if owner is not None and owner != kind:
        raise OutputDirError(f"{out} belongs to a {owner} command ({out / MARKER}); {KINDS[kind]} cannot use it: "
                             "pick another folder")
    if existing_run:
        if owner is None:
            raise OutputDirError(f"{out} is not a folder made by mmdit-strict {KINDS[kind]} (no {MARKER} marker)")
        return out
    if out.is_dir() and owner is None:
        foreign = sorted(p.name for p in out.iterdir() if p.name != LOCK)
        if foreign:
            shown = ", ".join(foreign[:5]) + (", …" if len(foreign) > 5 else "")
            raise OutputDirError(
                f"output_dir={out} holds files a run did not write ({shown}) and no {MARKER} marker; "
                "pick a new or empty folder"
            )
    return out


def _holder(lock: Path) -> str:
    try:
        info = json.loads(lock.read_text())
        return f"process {info['pid']} on {info['host']} (since {info['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


@contextlib.contextmanager
def claim_output_dir(path: str | Path, *, kind: str = "run", existing_run: bool = False) -> Iterator[Path]:
    """Check ``path`` (see :func:`check_output_dir`), create it, lock it and mark it as a ``kind`` folder.

    Fails at once with :class:`OutputDirError` when another process holds the lock. The lock is
    released when the block exits. With ``existing_run=True`` the folder must already be marked;
    nothing but the lock file is written.
    """
    out = check_output_dir(path, kind=kind, existing_run=existing_run)
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputDirError(
                f"output_dir={out} is in use by {_holder(out / LOCK)}; wait for it to finish or pick another output_dir"
            ) from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        if not (out / MARKER).exists():
            from .. import __version__

            atomic_write_text(out / MARKER, json.dumps({"written_by": "mmdit-strict", "kind": kind, "version": __version__,
                                                       "created": info["since"]}) + "\n")
        yield out
    finally:
        os.close(fd)

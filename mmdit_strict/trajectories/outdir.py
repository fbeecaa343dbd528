"""Output folders a run may write into, and the lock that keeps two runs out of one folder.

A run writes into ``output_dir`` only when the folder

* does not exist yet (it is created), or is empty, or
* holds the marker file ``.mmdit-strict-run`` that an earlier run wrote there.

Any other folder (the user's ``configs/``, the current folder, a home directory) is refused, so a
run never overwrites files it did not write.

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


class OutputDirError(ValueError):
    """The output folder cannot be used: not a folder, foreign files, or in use by another run."""


def check_output_dir(path: str | Path, *, existing_run: bool = False) -> Path:
    """Raise :class:`OutputDirError` unless a run may write into ``path``; return it as a ``Path``.

    ``existing_run=True`` (for ``report``) asks for an existing folder and skips the foreign-file check.
    """
    if not str(path).strip():
        raise OutputDirError("output_dir must name a folder, got an empty string")
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"output_dir={out} exists and is not a folder")
    if existing_run:
        if not out.is_dir():
            raise OutputDirError(f"{out} is not a folder")
        return out
    if out.is_dir():
        entries = sorted(p.name for p in out.iterdir())
        foreign = [e for e in entries if e != LOCK]
        if foreign and MARKER not in entries:
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
def claim_output_dir(path: str | Path, *, existing_run: bool = False) -> Iterator[Path]:
    """Check ``path`` (see :func:`check_output_dir`), create it, lock it and mark it as a run folder.

    Fails at once with :class:`OutputDirError` when another process holds the lock. The lock is
    released when the block exits.
    """
    out = check_output_dir(path, existing_run=existing_run)
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

            atomic_write_text(out / MARKER, json.dumps({"written_by": "mmdit-strict", "version": __version__,
                                                       "created": info["since"]}) + "\n")
        yield out
    finally:
        os.close(fd)

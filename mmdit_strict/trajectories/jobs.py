"""The status table of a command that runs many jobs (``-m`` sweeps, ``ablate``), kept on disk as it goes.

One YAML file in the command's output folder (``multirun.yaml``, ``ablation.yaml``) holds a list of
rows under one key, one row per job, each with at least ``status`` and ``exit_code``. It is written
atomically when the table is made (every job ``pending``) and again whenever a row changes, so a
killed command leaves the state of every job behind: ``pending``, ``running``, its end status, or
``not run`` when the command stopped before it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..io import atomic_write_text


class JobTable:
    """Rows of jobs under ``key`` in the YAML file ``path``; every change rewrites the file."""

    def __init__(self, path: str | Path, rows: list[dict[str, Any]], key: str = "jobs") -> None:
        self.path = Path(path)
        self.key = key
        self.rows = rows
        for row in rows:
            row.setdefault("status", "pending")
            row.setdefault("exit_code", None)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, yaml.safe_dump({self.key: self.rows}, sort_keys=False))

    def start(self, row: dict[str, Any]) -> None:
        """``row``'s job begins."""
        row["status"] = "running"
        self.write()

    def end(self, row: dict[str, Any], status: str, exit_code: int | None, **fields: Any) -> None:
        """``row``'s job ended with ``status`` and ``exit_code``; ``fields`` are recorded with them."""
        row.update(status=status, exit_code=exit_code, **fields)
        self.write()

    def stop(self) -> None:
        """The command stops here: every job still pending is ``not run``."""
        for row in self.rows:
            if row["status"] == "pending":
                row["status"] = "not run"
        self.write()

    @property
    def finished(self) -> int:
        """How many jobs have an exit code."""
        return sum(r["exit_code"] is not None for r in self.rows)

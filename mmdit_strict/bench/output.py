"""Where a benchmark's report lands: ``<stem>.json`` and its rendered ``<stem>.md`` in the output folder."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_report(out: str | Path, stem: str, report: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> str:
    """Write ``report`` as ``out/<stem>.json`` and ``render(report)`` as ``out/<stem>.md`` (the folder made if
    needed); returns the markdown."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    md = render(report)
    (folder / f"{stem}.json").write_text(json.dumps(report, indent=2))
    (folder / f"{stem}.md").write_text(md)
    return md

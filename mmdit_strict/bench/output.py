"""Where a benchmark's report lands: ``<stem>.json`` and its rendered ``<stem>.md`` in the output folder,
and the redrawing of a written report's figure."""

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


def replot(src: str | Path, plot: Callable[[dict[str, Any], Path], bool], tool: str, nothing: str) -> int:
    """Redraw the figure of a written report ``src`` (JSON) as ``src`` with a ``.png`` suffix, with ``plot``;
    SystemExit naming ``tool`` when there is no report, or ``nothing`` when ``plot`` found nothing to draw."""
    path = Path(src)
    if not path.is_file():
        raise SystemExit(f"{tool} --replot: no report at {path}")
    target = path.with_suffix(".png")
    if not plot(json.loads(path.read_text()), target):
        raise SystemExit(f"{tool} --replot: {path} holds {nothing}")
    print(target)
    return 0

"""The Markdown pieces every qualification report is built from: table rows, table sections, closing lines.

A report renderer turns its JSON rows into cells and leaves the layout to these functions, so every
report lays a section out the same way::

    ## <title>
    <blank>
    <note>            (zero or more, each followed by a blank line)
    <blank>
    | col | col |
    |---|---|
    | cell | cell |   (one line per row)
    <blank>
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any


def row(*cells: Any) -> str:
    """One table line: ``| a | b |`` (each cell as ``str`` would write it)."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def section(title: str, columns: Sequence[str], rows: Iterable[str], notes: Sequence[str] = ()) -> list[str]:
    """The lines of one table section: heading, ``notes`` (each a paragraph), header, separator, ``rows``
    (already-formatted table lines, see :func:`row`), and a closing blank line."""
    lines = [f"## {title}", ""]
    for note in notes:
        lines += [note, ""]
    return [*lines, row(*columns), "|" + "---|" * len(columns), *rows, ""]


def rows_section(rows: Sequence[Any] | None, title: str | Callable[[Sequence[Any]], str], columns: Sequence[str],
                 cells: Callable[[Any], str], notes: Sequence[str] = ()) -> list[str]:
    """The :func:`section` of one of a report's row lists: ``cells`` turns each row into its table line;
    ``title`` is a string or a function of the rows (for a count in the heading, see :func:`passed`).
    No lines where ``rows`` is empty or None: a report without that section renders without it."""
    if not rows:
        return []
    return section(title(rows) if callable(title) else title, columns, [cells(r) for r in rows], notes)


def passed(rows: Sequence[dict], key: str = "pass") -> str:
    """``"<k>/<n> pass"``: how many of the ``n`` rows have a true ``key``."""
    return f"{sum(r[key] for r in rows)}/{len(rows)} pass"


def errors_and_wall_time(report: dict) -> list[str]:
    """The closing lines of a report: its ``errors`` (when any) as a list section, then its wall time."""
    lines = ["## Errors", ""] + [f"- {x}" for x in report["errors"]] + [""] if report.get("errors") else []
    wall = report.get("wall_s")
    return lines + ["Wall time not recorded." if wall is None else f"Wall time {wall:.0f} s."]

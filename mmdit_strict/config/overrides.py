"""Command-line overrides as hydra writes them: parsing, values and multirun sweeps.

Grammar (one override per argument):

* ``key=value``  set an existing key (``group=option`` picks a config file of a group);
* ``+key=value`` add a key that does not exist yet (an existing key is an error, as in hydra);
* ``++key=value`` set the key, adding it if missing;
* ``~key`` / ``~key=value`` delete a key (only when its value is ``value``, if given); ``~group``
  drops a group from the defaults list.

Values are read as YAML scalars the way hydra reads them: ``null`` → None, ``true`` / ``false``,
integers, floats (``1e-3`` too), ``[a, b]`` lists and ``{a: 1}`` mappings; quotes keep text as text
(``key='null'``); ``on`` / ``off`` / ``yes`` / ``no`` stay text (``runtime=off`` is an option name).

Multirun (``-m``): a value with top-level commas (``sampler.num_steps=4,8``) is a sweep; the jobs are
the cartesian product of all sweeps, in the order the overrides were given (last one varies fastest).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import yaml

_TEXT_WORDS = {"on", "off", "yes", "no", "y", "n"}


class OverrideError(ValueError):
    """An override does not follow the grammar above."""


@dataclass(frozen=True)
class Override:
    """One parsed override. ``op`` is ``set``, ``add`` (``+``), ``force`` (``++``) or ``delete`` (``~``)."""

    op: str
    key: str
    raw: str | None  # the text after '=' (None for a bare ``~key``)

    @property
    def value(self) -> Any:
        return None if self.raw is None else parse_value(self.raw)


def parse_override(item: str) -> Override:
    """Parse ``[+|++|~]key[=value]``; raises :class:`OverrideError` naming the override."""
    text = item.strip()
    if text.startswith("~"):
        op, text = "delete", text[1:]
    elif text.startswith("++"):
        op, text = "force", text[2:]
    elif text.startswith("+"):
        op, text = "add", text[1:]
    else:
        op = "set"
    if "=" in text:
        key, raw = text.split("=", 1)
    elif op == "delete":
        key, raw = text, None
    else:
        raise OverrideError(f"override {item!r} is not of the form key=value or group=option")
    key = key.strip()
    if not key:
        raise OverrideError(f"override {item!r} has an empty key")
    if key.startswith(("+", "~")):
        raise OverrideError(f"override {item!r}: use one prefix (+ add, ++ add or set, ~ delete)")
    return Override(op, key, raw)


def parse_value(raw: str) -> Any:
    """The value hydra would give ``raw`` (see the module docstring)."""
    text = raw.strip()
    if text == "":
        return ""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text.lower() in _TEXT_WORDS:
        return text
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if value is None:
        return None
    if isinstance(value, bool):
        return value if text.lower() in ("true", "false") else text
    if isinstance(value, (int, float)):
        return value if _looks_numeric(text) else text  # YAML 1.1 oddities (0o17, 1:30) stay text
    if isinstance(value, list):
        return value if text.startswith("[") else text
    if isinstance(value, dict):
        return value if text.startswith("{") else text  # "a: b" is text, not a mapping
    if isinstance(value, str):
        return float(text) if _looks_numeric(text) else value  # 1e-3 is a float (YAML 1.1 wants a dot)
    return text  # dates and other YAML types stay text


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return text.lower() in (".inf", "-.inf", "+.inf", ".nan")
    return True


def split_sweep(raw: str) -> list[str]:
    """Split a value on commas that are outside brackets, braces and quotes (``a,[1,2],'x,y'``)."""
    parts, depth, quote, cur = [], 0, "", []
    for ch in raw:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
            cur.append(ch)
        elif ch in "[{":
            depth += 1
            cur.append(ch)
        elif ch in "]}":
            depth -= 1
            cur.append(ch)
        elif ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def expand_multirun(overrides: Sequence[str]) -> list[list[str]]:
    """The jobs of a multirun: one override list per point of the cartesian product of the sweeps."""
    choices: list[list[str]] = []
    for item in overrides:
        o = parse_override(item)
        if o.raw is None or o.op == "delete":
            choices.append([item])
            continue
        values = split_sweep(o.raw)
        if any(v.strip() == "" for v in values) and len(values) > 1:
            raise OverrideError(f"sweep {item!r} has an empty value")
        prefix = item[: len(item) - len(o.raw)]
        choices.append([prefix + v for v in values])
    return [list(job) for job in itertools.product(*choices)]

"""Start-up agreement: every rank must run the same composed config and load the same model.

The ranks all-gather what they composed (every leaf of the resolved config, by dotted key) and,
once each has built its model, the architecture fingerprint and weight / LoRA hashes. Any value that
differs from rank 0's is refused on every rank with an error naming the rank and the key.
"""

from __future__ import annotations

from typing import Any, Mapping

from .runtime import all_gather, current

#: Config keys that may differ between ranks (they do not reach any rank's bytes or files).
RANK_FREE = ("progress",)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``; lists stay values."""
    if isinstance(tree, Mapping):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: tree}


def differences(mine: Mapping[str, Any], root: Mapping[str, Any]) -> list[str]:
    """Keys whose values differ between ``mine`` and ``root`` (absent on one side counts), sorted."""
    return sorted(k for k in set(mine) | set(root) if mine.get(k, "<absent>") != root.get(k, "<absent>"))


def agree(what: str, values: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` on every rank unless every rank holds ``values`` equal to rank 0's. No-op in a single process."""
    if current() is None:
        return
    got = all_gather(f"agree on {what}", dict(values))
    problems = []
    for r, theirs in enumerate(got[1:], start=1):
        for key in differences(theirs, got[0]):
            problems.append(f"rank {r}'s {key}={theirs.get(key, '<absent>')!r} differs from rank 0's {got[0].get(key, '<absent>')!r}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; … ({len(problems)} differences)" if len(problems) > 5 else "")
        raise ValueError(f"the ranks disagree on the {what}: {shown}; every rank must run the same command line")


def agree_config(container: Mapping[str, Any]) -> None:
    """:func:`agree` on the resolved config (a plain dict), leaving out :data:`RANK_FREE` keys."""
    flat = {k: v for k, v in flatten(container).items() if k.split(".")[0] not in RANK_FREE}
    agree("composed config", flat)

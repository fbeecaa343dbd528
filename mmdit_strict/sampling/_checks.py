"""Argument checks shared by the sampling modules."""

from __future__ import annotations


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` itself if it is an ``int`` (not a bool) of at least ``minimum``; TypeError / ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value

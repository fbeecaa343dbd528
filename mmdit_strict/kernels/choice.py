"""A named choice among kernel variants, with a default, set for a block of code (context-local)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from ..context import bound


class KernelChoice:
    """``current()`` is the innermost ``use(name)`` in force, else ``default``; unknown names are refused."""

    def __init__(self, what: str, options: tuple[str, ...], default: str) -> None:
        if default not in options:
            raise ValueError(f"default {default!r} of {what} is not one of {options}")
        self.what, self.options = what, options
        self._var: contextvars.ContextVar[str] = contextvars.ContextVar(f"mmdit_{what.replace(' ', '_')}", default=default)

    def current(self) -> str:
        return self._var.get()

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[None]:
        if name not in self.options:
            raise ValueError(f"{self.what} must be one of {self.options}, got {name!r}")
        with bound(self._var, name):
            yield

"""A named choice among kernel options, held in a field of the execution context (:mod:`.execution`),
such as the GEMM stream."""

from __future__ import annotations

from contextlib import AbstractContextManager

from .execution import ExecutionContext, current, switch



class ContextChoice:
    """A named choice among ``options`` held in field ``field`` of the execution context.

    ``current()`` is the field of the context in force; ``use(name)`` refuses an unknown name (ValueError,
    before binding) and enters the context in force with the field switched to ``name``.
    """

    def __init__(self, what: str, options: tuple[str, ...], field: str) -> None:
        default = getattr(ExecutionContext(), field)
        if default not in options:
            raise ValueError(f"default {default!r} of {what} is not one of {options}")
        self.what, self.options, self.field = what, options, field

    def current(self) -> str:
        return getattr(current(), self.field)

    get = current

    def use(self, name: str) -> AbstractContextManager[None]:
        """A context manager in which ``current()`` is ``name`` (nothing is set when it already is)."""
        if name not in self.options:
            raise ValueError(f"{self.what} must be one of {self.options}, got {name!r}")
        return switch(self.field, name)

"""A kernel setting set for a block of code (context-local): a named choice among variants, or a launch.

:class:`ContextChoice` is a choice held in a field of the execution context (:mod:`.execution`), such as
the GEMM stream. :class:`KernelSetting` / :class:`KernelChoice` hold kernel-local settings outside it
(each in its own context variable).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Generic, TypeVar

from ..context import bound
from .execution import ExecutionContext, current, switch

T = TypeVar("T")


class KernelSetting(Generic[T]):
    """``get()`` is the innermost ``use(value)`` in force, else ``default``; ``use`` first calls
    ``check(value)``, which raises ValueError for a value it refuses (inside the ``with``, before binding)."""

    def __init__(self, what: str, default: T, check: Callable[[T], None]) -> None:
        self.what, self._check = what, check
        self._var: contextvars.ContextVar[T] = contextvars.ContextVar(f"mmdit_{what.replace(' ', '_')}", default=default)

    def get(self) -> T:
        return self._var.get()

    def use(self, value: T) -> AbstractContextManager[object]:
        """A context manager in which ``get()`` is ``value``. Checked here; binding the value already in force
        is skipped (nothing to set or restore)."""
        self._check(value)
        if self._var.get() == value:
            return contextlib.nullcontext()
        return bound(self._var, value)


class KernelChoice(KernelSetting[str]):
    """``current()`` is the innermost ``use(name)`` in force, else ``default``; unknown names are refused."""

    def __init__(self, what: str, options: tuple[str, ...], default: str) -> None:
        if default not in options:
            raise ValueError(f"default {default!r} of {what} is not one of {options}")
        self.options = options
        super().__init__(what, default, self._known)

    def _known(self, name: str) -> None:
        if name not in self.options:
            raise ValueError(f"{self.what} must be one of {self.options}, got {name!r}")

    def current(self) -> str:
        return self.get()


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

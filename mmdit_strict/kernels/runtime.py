"""Runtime modes and the strict-math guards (docs/design.md §4).

The active mode and the active operator trace live in context variables, set through
:func:`runtime_mode`; library code never flips module globals.
"""

from __future__ import annotations

import contextlib
import contextvars
from enum import Enum
from typing import Iterator

import torch

from ..context import bound


class Runtime(str, Enum):
    """How operators are chosen.

    STRICT: only qualified batch-invariant implementations; anything else raises (fail closed).
    AUDIT:  strict results are returned; the production path also runs and its drift is recorded.
    AUTO:   strict where qualified, production fallback elsewhere, every fallback recorded.
    OFF:    plain PyTorch production path (cuBLAS / SDPA / MKL), no invariance promised.
    """

    STRICT = "strict"
    AUDIT = "audit"
    AUTO = "auto"
    OFF = "off"

    @classmethod
    def parse(cls, value: "str | Runtime") -> "Runtime":
        if isinstance(value, Runtime):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(
                f"unknown runtime {value!r}; choose one of {[m.value for m in cls]}"
            ) from None


_MODE: contextvars.ContextVar[Runtime] = contextvars.ContextVar("mmdit_strict_runtime", default=Runtime.OFF)


def current_runtime() -> Runtime:
    """The runtime mode of the innermost :func:`runtime_mode` block (``off`` outside any)."""
    return _MODE.get()


@contextlib.contextmanager
def strict_math() -> Iterator[None]:
    """Pin the arithmetic policy: TF32 off, deterministic algorithms on; restored on exit."""
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.get_float32_matmul_precision(),
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.backends.cudnn.allow_tf32 = saved[1]
        torch.use_deterministic_algorithms(saved[2], warn_only=saved[3])
        torch.set_float32_matmul_precision(saved[4])


@contextlib.contextmanager
def runtime_mode(mode: "str | Runtime") -> Iterator[Runtime]:
    """Run the enclosed code in ``mode``; strict-like modes also pin the math policy."""
    mode = Runtime.parse(mode)
    with bound(_MODE, mode):
        if mode is Runtime.OFF:
            yield mode
        else:
            with strict_math():
                yield mode


def tf32_state() -> dict[str, bool]:
    return {
        "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
    }

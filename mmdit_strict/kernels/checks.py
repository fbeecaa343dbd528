"""Operand checks shared by the kernel launchers: a clear ValueError before anything launches."""

from __future__ import annotations

import torch


def check_operand(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device, *,
                  dtype_of: str = "the execution dtype", layout: str = "row-major") -> None:
    """``t`` has ``dtype`` (named after ``dtype_of`` in the message), lives on ``device`` and is contiguous."""
    if t.dtype != dtype:
        raise ValueError(f"expected {name} of dtype {dtype} ({dtype_of}), got {t.dtype}")
    if t.device != device:
        raise ValueError(f"expected {name} on {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"expected {name} to be contiguous ({layout}), got strides {tuple(t.stride())}")

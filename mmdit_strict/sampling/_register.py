"""Registry entries of the sampling operators (device-agnostic eager FP32 with fixed reduction trees)."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)


def register_sampling_op(op: str, fn: Callable[..., Any], kernel_name: str, reduction_order: str,
                         config: dict[str, Any] | None = None) -> None:
    """Register ``fn`` as the strict ``torch_fixed`` implementation of ``op`` on cpu and cuda (fp32)."""
    try:
        from mmdit_strict.kernels.registry import KernelImpl, register
    except Exception as exc:  # the registry is optional for the sampling math
        logger.debug("%s not registered: %s", op, exc)
        return
    for dev in ("cpu", "cuda"):
        register(KernelImpl(
            op=op, backend="torch_fixed", device=dev, dtypes=frozenset({torch.float32}), fn=fn, strict=True, split_k=False,
            kernel_name=kernel_name, source=fn, config=dict(config or {}), reduction_order=reduction_order,
        ))

"""One hash of everything an optimizer update changes: the LoRA tensors, the optimizer and scheduler state, the EMA."""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch

from ..io import tensor_bytes


def _feed(h: "hashlib._Hash", key: str, value: Any) -> None:
    h.update(key.encode())
    if isinstance(value, torch.Tensor):
        h.update(f"{value.dtype}{tuple(value.shape)}".encode())
        h.update(tensor_bytes(value))
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            _feed(h, f"{key}.{k}", value[k])
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _feed(h, f"{key}[{i}]", v)
    else:
        h.update(repr(value).encode())


def state_digest(named: Sequence[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer,
                 scheduler: Any, ema: Any | None) -> str:
    """sha256 over the LoRA tensors (by name), ``optimizer.state_dict()``, ``scheduler.state_dict()`` and the
    EMA shadow: equal on two ranks exactly when the next update starts from the same bytes."""
    h = hashlib.sha256()
    for n, p in named:
        _feed(h, f"lora.{n}", p.detach())
    _feed(h, "optimizer", optimizer.state_dict())
    _feed(h, "scheduler", {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"})
    if ema is not None:
        _feed(h, "ema", ema.state_dict())
    return h.hexdigest()

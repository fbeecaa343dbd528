"""The one place dtypes are named: execution dtypes, their short names (traces, tolerances, reports) and
the names configs use (``model.dtype``)."""

from __future__ import annotations

from types import MappingProxyType

import torch

#: The dtypes a strict operator executes in: the checkpoint's BF16 and FP32 (docs/design.md §3).
EXECUTION_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)

#: torch dtype → short name, as traces, the registry, the tolerance contract and reports write it.
SHORT_NAMES = MappingProxyType({torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                                torch.float64: "fp64"})

#: short name → torch dtype (the inverse of :data:`SHORT_NAMES`).
BY_SHORT_NAME = MappingProxyType({v: k for k, v in SHORT_NAMES.items()})

#: short name → execution dtype, BF16 first (the order the benchmarks report them in).
EXECUTION_BY_SHORT_NAME = MappingProxyType({"bf16": torch.bfloat16, "fp32": torch.float32})

#: config name (``model.dtype``, ``--dtype``) → torch dtype.
BY_CONFIG_NAME = MappingProxyType({"float32": torch.float32, "bfloat16": torch.bfloat16})


def short_name(dtype: torch.dtype) -> str:
    """``fp32`` / ``bf16`` / …; ``str(dtype)`` for a dtype without a short name."""
    return SHORT_NAMES.get(dtype, str(dtype))


def from_config(name: str) -> torch.dtype:
    """The torch dtype of a config name (``float32`` | ``bfloat16``); a ValueError names the valid ones."""
    try:
        return BY_CONFIG_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(BY_CONFIG_NAME)}") from None

"""Loader for the tolerance contract (``tolerances.yaml``): every non-byte comparison's bound and reason."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

_PATH = Path(__file__).with_name("tolerances.yaml")
_DTYPE_KEYS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float64: "fp64", torch.float16: "fp16"}


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float
    reason: str

    def check(self, actual: torch.Tensor, expected: torch.Tensor) -> tuple[bool, float, float]:
        """Return (passed, max_abs_err, max_rel_err) of ``actual`` against ``expected`` (compared in FP64)."""
        a = actual.detach().to("cpu", torch.float64)
        e = expected.detach().to("cpu", torch.float64)
        if a.shape != e.shape:
            raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(e.shape)}")
        err = (a - e).abs()
        bound = self.atol + self.rtol * e.abs()
        passed = bool((err <= bound).all()) and bool(torch.isfinite(a).all())
        max_abs = float(err.max()) if err.numel() else 0.0
        max_rel = float((err / e.abs().clamp_min(1e-30)).max()) if err.numel() else 0.0
        return passed, max_abs, max_rel


@functools.lru_cache(maxsize=1)
def _contract() -> dict:
    return OmegaConf.to_container(OmegaConf.load(_PATH), resolve=True)  # type: ignore[return-value]


def tolerance(section: str, check: str, dtype: torch.dtype | str) -> Tolerance:
    """Look up ``section.check.dtype`` in the contract; a missing entry is an error, never a default."""
    key = dtype if isinstance(dtype, str) else _DTYPE_KEYS.get(dtype, str(dtype))
    try:
        entry = _contract()[section][check][key]
    except KeyError:
        raise KeyError(f"no tolerance declared for {section}.{check}.{key} in {_PATH.name}") from None
    return Tolerance(rtol=float(entry["rtol"]), atol=float(entry["atol"]), reason=str(entry["reason"]))


def all_entries() -> dict:
    return _contract()

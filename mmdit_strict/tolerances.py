"""Loader for the tolerance contract (``tolerances.yaml``): every non-byte comparison's bound and reason.

An entry is ``{rtol, atol | atol_max, reason}``; each key name has one meaning everywhere:

* ``rtol``: relative to the expected value, elementwise (``rtol·|expected|``);
* ``atol``: absolute, in the tensor's own units;
* ``atol_max``: a fraction of the largest expected magnitude of the compared tensor
  (``atol_max·max|expected|``), for kernels whose absolute error scales with the tensor.

A check passes when ``|actual − expected| ≤ atol + atol_max·max|expected| + rtol·|expected|``
elementwise (and ``actual`` is finite). A missing entry, a missing reason or an unknown key is an error.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from .dtypes import short_name
from omegaconf import OmegaConf

_PATH = Path(__file__).with_name("tolerances.yaml")
ENTRY_KEYS = frozenset({"rtol", "atol", "atol_max", "reason"})


@dataclass(frozen=True)
class Tolerance:
    """An elementwise bound ``atol + atol_max·max|expected| + rtol·|expected|`` and why it is what it is."""

    rtol: float
    atol: float
    reason: str
    atol_max: float = 0.0

    def resolved(self, expected: torch.Tensor) -> "Tolerance":
        """This bound for one expected tensor with ``atol_max`` turned into an absolute ``atol``."""
        if not self.atol_max:
            return self
        peak = float(expected.detach().abs().max()) if expected.numel() else 0.0
        return Tolerance(rtol=self.rtol, atol=self.atol + self.atol_max * peak, reason=self.reason)

    def check(self, actual: torch.Tensor, expected: torch.Tensor) -> tuple[bool, float, float]:
        """Return (passed, max_abs_err, max_rel_err) of ``actual`` against ``expected`` (compared in FP64)."""
        a = actual.detach().to("cpu", torch.float64)
        e = expected.detach().to("cpu", torch.float64)
        if a.shape != e.shape:
            raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(e.shape)}")
        err = (a - e).abs()
        bound = self.resolved(e).atol + self.rtol * e.abs()
        passed = bool((err <= bound).all()) and bool(torch.isfinite(a).all())
        max_abs = float(err.max()) if err.numel() else 0.0
        max_rel = float((err / e.abs().clamp_min(1e-30)).max()) if err.numel() else 0.0
        return passed, max_abs, max_rel


@functools.lru_cache(maxsize=1)
def _contract() -> dict:
    return OmegaConf.to_container(OmegaConf.load(_PATH), resolve=True)  # type: ignore[return-value]


def from_entry(entry: dict, where: str) -> Tolerance:
    """A :class:`Tolerance` from one ``{rtol, atol | atol_max, reason}`` mapping; ``where`` names it in errors."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: a tolerance entry must be a mapping, got {entry!r}")
    unknown = set(entry) - ENTRY_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(ENTRY_KEYS)})")
    if "rtol" not in entry or not ({"atol", "atol_max"} & set(entry)):
        raise ValueError(f"{where}: needs rtol and one of atol (absolute) / atol_max (fraction of max|expected|)")
    reason = entry.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError(f"{where}: every tolerance needs a non-empty reason")
    return Tolerance(rtol=float(entry["rtol"]), atol=float(entry.get("atol", 0.0)), reason=reason,
                     atol_max=float(entry.get("atol_max", 0.0)))


def tolerance(section: str, check: str, dtype: torch.dtype | str) -> Tolerance:
    """Look up ``section.check.dtype`` in the contract; a missing entry is an error, never a default."""
    key = dtype if isinstance(dtype, str) else short_name(dtype)
    try:
        entry = _contract()[section][check][key]
    except KeyError:
        raise KeyError(f"no tolerance declared for {section}.{check}.{key} in {_PATH.name}") from None
    return from_entry(entry, f"{_PATH.name} {section}.{check}.{key}")


def all_entries() -> dict:
    return _contract()

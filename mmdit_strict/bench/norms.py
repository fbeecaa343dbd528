"""Qualification of the strict row operators on the GPU (placeholder header, replaced below)."""

from __future__ import annotations

import torch

from mmdit_strict.tolerances import Tolerance, tolerance


def row_tolerance(check: str, dtype: torch.dtype | str, ref: torch.Tensor) -> Tolerance:
    """``tolerances.yaml`` ``row_ops.<check>.<dtype>`` as a :class:`Tolerance` whose atol is the declared
    fraction times max|ref| of that tensor (the section's comparison form)."""
    t = tolerance("row_ops", check, dtype)
    peak = float(ref.detach().abs().max()) if ref.numel() else 0.0
    return Tolerance(rtol=t.rtol, atol=t.atol * peak, reason=t.reason)

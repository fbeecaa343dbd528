"""Classifier-free guidance with per-token norm rescale (operator ``cfg_combine_renorm``).

Math (docs/design.md §2; diffusers' ``QwenImagePipeline``), per token (last dim = 64 packed channels):

    comb  = neg + s * (cond - neg)
    out   = comb * (||cond|| / ||comb||)

Arithmetic (FP32 only, every op a separate elementwise tensor op, so any device gives the same bytes):

    diff   = cond - neg
    comb   = neg + s32 * diff                   s32 = the Python float ``scale`` rounded once to FP32
    n_c    = sqrt_rn(tree_sum(cond * cond, -1)) fixed pairwise tree (see ``tree.py``) over the 64 channels,
    n_m    = sqrt_rn(tree_sum(comb * comb, -1)) correctly rounded sqrt (``tree.sqrt_rn``; torch.sqrt is not)
    ratio  = n_c / n_m                          (0 where n_m == 0: a zero combination stays zero)
    out    = comb * ratio

``comb`` is byte-equal to diffusers' ``comb_pred``. The norms use our tree where diffusers uses
``torch.norm`` (whose reduction order is the backend's choice), so ``out`` differs from diffusers by a
few FP32 ulps (tolerance ``sampling.cfg_vs_diffusers``). Each token depends only on its own 64
values through a tree fixed by the channel count, so the result is batch- and token-count-invariant by
construction. Where diffusers returns NaN (``||comb|| == 0``) we return zeros.

Differentiable (the training recompute backpropagates through CFG): plain autograd everywhere except
the per-token broadcast multiply, whose backward channel sum would use the backend's reduction order;
a small autograd function does that sum with the same fixed tree, so gradients are also batch- and
device-invariant.
"""

from __future__ import annotations

import math

import torch

from .tree import TREE_ORDER, sqrt_rn, tree_sum
from ._register import register_sampling_op

__all__ = ["cfg_combine", "SUPPORTED_DTYPES"]


SUPPORTED_DTYPES = (torch.float32,)


def _check_inputs(cond: torch.Tensor, neg: torch.Tensor, scale: float) -> None:
    for name, t in (("cond", cond), ("neg", neg)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"{name} must be float32 (cfg_combine supports {[str(d) for d in SUPPORTED_DTYPES]}); "
                f"got {t.dtype}. Cast the model output to float32 once before guidance."
            )
        if t.dim() < 1 or t.shape[-1] == 0:
            raise ValueError(f"{name} needs a non-empty last (channel) dimension, got shape {tuple(t.shape)}")
    if cond.shape != neg.shape:
        raise ValueError(f"cond and neg must have the same shape, got {tuple(cond.shape)} and {tuple(neg.shape)}")
    if cond.device != neg.device:
        raise ValueError(f"cond and neg must be on the same device, got {cond.device} and {neg.device}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale}")
    for name, t in (("cond", cond), ("neg", neg)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} contains NaN or Inf")


class _TokenScale(torch.autograd.Function):
    """``out = comb * ratio`` with ``ratio`` of shape ``(..., 1)``.

    Autograd's own backward for this broadcast sums ``grad * comb`` over the channels with the
    backend's reduction order (it differs between CPU and CUDA); here that sum uses the fixed tree:
    ``d_comb = grad * ratio``, ``d_ratio = tree_sum(grad * comb, -1, keepdim=True)``.
    """

    @staticmethod
    def forward(ctx, comb: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(comb, ratio)
        return comb * ratio

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        comb, ratio = ctx.saved_tensors
        d_comb = grad * ratio if ctx.needs_input_grad[0] else None
        d_ratio = tree_sum(grad * comb, dim=-1, keepdim=True) if ctx.needs_input_grad[1] else None
        return d_comb, d_ratio


def cfg_combine(cond: torch.Tensor, neg: torch.Tensor, scale: float) -> torch.Tensor:
    """Guided velocity with per-token renormalisation to the conditional norm.

    Args:
        cond: conditional velocity ``(..., C)`` float32, typically ``(B, T_img, 64)``.
        neg: unconditional / negative-prompt velocity, same shape, dtype and device.
        scale: guidance scale ``s`` (``true_cfg_scale``), a finite Python float.

    Returns:
        ``(..., C)`` float32: ``comb * ||cond|| / ||comb||`` per token (norms over the last dim).
    """
    _check_inputs(cond, neg, scale)
    s32 = torch.tensor(float(scale), dtype=torch.float32, device=cond.device)
    comb = neg + s32 * (cond - neg)
    cond_norm = sqrt_rn(tree_sum(cond * cond, dim=-1, keepdim=True))
    comb_norm = sqrt_rn(tree_sum(comb * comb, dim=-1, keepdim=True))
    nonzero = comb_norm > 0
    safe = torch.where(nonzero, comb_norm, torch.ones_like(comb_norm))
    ratio = torch.where(nonzero, cond_norm / safe, torch.zeros_like(comb_norm))
    return _TokenScale.apply(comb, ratio)


register_sampling_op("cfg_combine_renorm", cfg_combine, "mmdit_strict.sampling.cfg.cfg_combine",
                     f"per-token L2 norm over the last dim: {TREE_ORDER}")

"""Strict arithmetic helpers for the sampling math: the fixed pairwise reduction tree used by every
sampling-side sum (CFG norms, SDE log-probabilities), and a correctly rounded FP32 square root.

Reduction order (frozen; part of the arithmetic contract, docs/design.md §3.1):

    Let ``n`` be the length of the reduced dimension and ``p`` the smallest power of two ``>= n``.
    The values are padded with ``+0.0`` to length ``p``. Then, while ``p > 1``:

        p      = p // 2
        x[i]   = x[i] + x[i + p]        for i in [0, p)      (one FP32 add per pair)

    The result is ``x[0]``.

Every add is a plain elementwise tensor add, so the result is correctly rounded per add on any
device and the tree depends only on ``n``: never on the batch size, on other rows, on the thread
count or on launch geometry. A row reduced alone and the same row reduced inside a batch give the
same bytes by construction. Adding a padding zero is exact (``a + 0.0 == a``; ``-0.0`` becomes
``+0.0``, which compares equal).

The tree is built from slicing and ``+``, so plain autograd differentiates through it; the
backward of a sum is a broadcast of the upstream gradient (no arithmetic), hence also invariant.
"""

from __future__ import annotations

import torch

__all__ = ["tree_sum", "sqrt_rn", "TREE_ORDER"]

TREE_ORDER = "pairwise halving tree over the reduced dim, zero-padded to a power of two: x[i] += x[i + p/2]"


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum ``x`` over ``dim`` with the fixed pairwise halving tree described in the module docstring.

    Args:
        x: floating tensor of any shape; the accumulation dtype is ``x.dtype`` (FP32 in strict mode).
        dim: the dimension to reduce.
        keepdim: keep the reduced dimension with size 1.

    Returns:
        ``x`` summed over ``dim``; an empty dimension sums to zeros.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"tree_sum expects a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"tree_sum expects a floating tensor, got dtype {x.dtype}")
    if x.dim() == 0:
        raise ValueError("tree_sum needs a tensor with at least one dimension, got a 0-d tensor")
    nd = x.dim()
    if not -nd <= dim < nd:
        raise ValueError(f"dim {dim} out of range for a tensor with {nd} dimensions")
    dim = dim % nd
    y = x.movedim(dim, -1)
    n = y.shape[-1]
    if n == 0:
        out = y.new_zeros(y.shape[:-1])
    else:
        p = 1
        while p < n:
            p *= 2
        if p != n:
            pad = y.new_zeros((*y.shape[:-1], p - n))
            y = torch.cat([y, pad], dim=-1)
        while p > 1:
            p //= 2
            y = y[..., :p] + y[..., p:]
        out = y[..., 0]
    if keepdim:
        out = out.unsqueeze(dim)
    return out


def _sqrt_rn_values(x: torch.Tensor) -> torch.Tensor:
    # Guess: float64 sqrt rounded to FP32 (within 1 FP32 ulp even if the float64 sqrt is off by an ulp).
    y = torch.sqrt(x.double()).to(torch.float32)
    x64 = x.double()
    up = torch.nextafter(y, torch.full_like(y, float("inf")))
    down = torch.nextafter(y, torch.zeros_like(y))
    # Midpoints of FP32 neighbours have <= 25 significant bits, so their squares are exact in float64.
    mid_up = (y.double() + up.double()) * 0.5
    mid_down = (y.double() + down.double()) * 0.5
    y = torch.where(x64 > mid_up * mid_up, up, y)
    y = torch.where(x64 < mid_down * mid_down, down, y)
    return y


class _SqrtRN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y = _sqrt_rn_values(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (y,) = ctx.saved_tensors
        return grad / (2 * y)  # torch.sqrt's own backward formula


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded (round-to-nearest-even) FP32 square root, the same bytes on every device.

    ``torch.sqrt`` is not correctly rounded everywhere (the CPU build used here is off by up to 1 ulp
    in FP32 and in FP64, and differs from CUDA), so strict code must not use it. This computes a guess
    ``fp32(sqrt(fp64(x)))`` (within 1 ulp) and corrects it with exact float64 comparisons against the
    squared midpoints of its FP32 neighbours: only exact operations decide the result.

    Args:
        x: FP32 tensor with ``x >= 0`` (negative inputs give NaN, as ``sqrt`` does).

    Returns:
        FP32 tensor; differentiable, backward ``grad / (2 * y)``.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"sqrt_rn expects float32, got {x.dtype}")
    return _SqrtRN.apply(x)

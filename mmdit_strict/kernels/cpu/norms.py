"""CPU strict normalisation and modulation operators.

All forward math is row-local (a row's bytes depend only on the row); parameters and per-sample
vectors reach the rows through :class:`BroadcastParam` / :class:`BroadcastRows`, whose backward
reduces over each sample's own rows with a pairwise tree and folds samples in index order.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..registry import KernelImpl, register
from .gemm import gemm
from .primitives import broadcast_param, broadcast_rows, check_seqlens, layer_norm_rows, rms_norm_rows

_F32 = frozenset({torch.float32})


def _check_rows(name: str, x: torch.Tensor, width: int | None = None) -> None:
    if x.dtype != torch.float32:
        raise ValueError(f"CPU strict {name} runs in float32, got {x.dtype}")
    if x.device.type != "cpu":
        raise ValueError(f"CPU strict {name} needs CPU tensors, got {x.device}")
    if width is not None and x.shape[-1] != width:
        raise ValueError(f"{name}: expected last dim {width}, got shape {tuple(x.shape)}")


def _check_vec(name: str, v: torch.Tensor, batch: int, width: int) -> None:
    if tuple(v.shape) != (batch, width):
        raise ValueError(f"{name}: expected per-sample tensor of shape ({batch}, {width}), got {tuple(v.shape)}")


def adaln_modulation(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, *, seqlens: Sequence[int], eps: float) -> torch.Tensor:
    """``LayerNorm(x)·(1 + scale[s]) + shift[s]``: x (M, D), shift/scale (B, D) → (M, D)."""
    _check_rows("adaln_modulation", x)
    seq = check_seqlens(seqlens, x.shape[0])
    for n, v in (("shift", shift), ("scale", scale)):
        _check_vec(f"adaln_modulation {n}", v, len(seq), x.shape[1])
    return layer_norm_rows(x, eps) * (1 + broadcast_rows(scale, seq)) + broadcast_rows(shift, seq)


def adaln_gate_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, *, seqlens: Sequence[int]) -> torch.Tensor:
    """``x + gate[s]·y``: x, y (M, D), gate (B, D) → (M, D)."""
    _check_rows("adaln_gate_residual", x)
    if y.shape != x.shape:
        raise ValueError(f"adaln_gate_residual: x {tuple(x.shape)} and y {tuple(y.shape)} differ")
    seq = check_seqlens(seqlens, x.shape[0])
    _check_vec("adaln_gate_residual gate", gate, len(seq), x.shape[1])
    return x + broadcast_rows(gate, seq) * y


def qk_rmsnorm(x: torch.Tensor, gain: torch.Tensor, *, seqlens: Sequence[int], eps: float) -> torch.Tensor:
    """Per-head RMSNorm with a learned gain: x (M, H, d), gain (d,) → (M, H, d)."""
    _check_rows("qk_rmsnorm", x)
    if x.dim() != 3 or tuple(gain.shape) != (x.shape[2],):
        raise ValueError(f"qk_rmsnorm: expected x (M, H, d) and gain (d,), got {tuple(x.shape)} and {tuple(gain.shape)}")
    seq = check_seqlens(seqlens, x.shape[0])
    M, H, d = x.shape
    rows = rms_norm_rows(x.reshape(M * H, d), eps)
    return (rows * broadcast_param(gain, M * H, tuple(n * H for n in seq))).reshape(M, H, d)


def txt_in_rmsnorm_linear(
    x: torch.Tensor, gain: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
    seqlens: Sequence[int], eps: float, lora: tuple | None = None,
) -> torch.Tensor:
    """``(RMSNorm(x)·gain) Wᵀ + b``: x (M, Ct) → (M, D)."""
    _check_rows("txt_in_rmsnorm_linear", x)
    seq = check_seqlens(seqlens, x.shape[0])
    if tuple(gain.shape) != (x.shape[1],):
        raise ValueError(f"txt_in_rmsnorm_linear: expected gain ({x.shape[1]},), got {tuple(gain.shape)}")
    h = rms_norm_rows(x, eps) * broadcast_param(gain, x.shape[0], seq)
    return gemm(h, weight, bias, seqlens=seq, lora=lora)


def final_adaln_out(
    x: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
    seqlens: Sequence[int], eps: float, lora: tuple | None = None,
) -> torch.Tensor:
    """``scale, shift = SiLU(temb) Wᵀ + b`` (that order); ``LayerNorm(x)·(1 + scale) + shift``."""
    _check_rows("final_adaln_out", x)
    seq = check_seqlens(seqlens, x.shape[0])
    _check_vec("final_adaln_out temb", temb, len(seq), x.shape[1])
    mod = gemm(temb, weight, bias, seqlens=(1,) * len(seq), prologue="silu", lora=lora)
    scale, shift = mod.chunk(2, dim=-1)
    return adaln_modulation(x, shift.contiguous(), scale.contiguous(), seqlens=seq, eps=eps)


_ROW = "row-local forward; parameter/per-sample grads: pairwise tree over each sample's own rows, folded in sample order"
for _op, _fn in (
    ("adaln_modulation", adaln_modulation),
    ("adaln_gate_residual", adaln_gate_residual),
    ("qk_rmsnorm", qk_rmsnorm),
    ("txt_in_rmsnorm_linear", txt_in_rmsnorm_linear),
    ("final_adaln_out", final_adaln_out),
):
    register(KernelImpl(op=_op, backend="cpu_strict", device="cpu", dtypes=_F32, fn=_fn, strict=True, split_k=False,
                        kernel_name=f"cpu_{_op}", reduction_order=_ROW))


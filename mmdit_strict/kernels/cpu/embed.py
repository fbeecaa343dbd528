"""CPU strict timestep embedding and multi-axis RoPE."""

from __future__ import annotations

import math

import torch

from ..registry import KernelImpl, register
from .gemm import gemm
from .primitives import elementwise

_F32 = frozenset({torch.float32})


def timestep_embed_mlp(
    sigma: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, *,
    channels: int, scale: float,
) -> torch.Tensor:
    """sigma (B,) → ``linear_2(SiLU(linear_1([cos | sin](scale·sigma·f))))`` (B, D), FP32.

    Frequencies ``f_i = exp(-ln(10000)·i/half)``, angles and their cos/sin are computed in FP64 and
    rounded once to FP32 (row-local, so batch-invariant).
    """
    if sigma.dim() != 1:
        raise ValueError(f"timestep_embed_mlp: expected sigma of shape (B,), got {tuple(sigma.shape)}")
    if sigma.dtype != torch.float32 or sigma.device.type != "cpu":
        raise ValueError(f"CPU strict timestep_embed_mlp needs float32 CPU sigma, got {sigma.dtype} on {sigma.device}")
    half = channels // 2
    # Angles reach scale·sigma = 1000 rad: FP32 arguments would carry ~6e-5 absolute error into
    # cos/sin. The B×channels table is computed in FP64 from the FP32 sigma and rounded once.
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / half)
    args = (float(scale) * sigma.double())[:, None] * freqs[None, :]
    emb = torch.cat([elementwise(torch.cos, args), elementwise(torch.sin, args)], dim=-1).to(torch.float32)
    ones = (1,) * sigma.shape[0]
    h = gemm(emb, w1, b1, seqlens=ones, epilogue="silu")
    return gemm(h, w2, b2, seqlens=ones)


def multi_axis_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs: x (M, H, d), cos/sin (M, d/2) → (M, H, d); products and one add each."""
    if x.dim() != 3 or cos.shape != (x.shape[0], x.shape[2] // 2) or sin.shape != cos.shape:
        raise ValueError(f"multi_axis_rope: expected x (M, H, d) and tables (M, d/2), got {tuple(x.shape)}, {tuple(cos.shape)}")
    if x.dtype != torch.float32:
        raise ValueError(f"CPU strict multi_axis_rope runs in float32, got {x.dtype}")
    pairs = x.unflatten(-1, (-1, 2))
    xr, xi = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([xr * c - xi * s, xr * s + xi * c], dim=-1).flatten(-2)


register(KernelImpl(op="timestep_embed_mlp", backend="cpu_strict", device="cpu", dtypes=_F32, fn=timestep_embed_mlp,
                    strict=True, split_k=False, kernel_name="cpu_timestep_embed_mlp", reduction_order="per-sample rows; GEMMs as cpu_tile_bmm_gemm"))
register(KernelImpl(op="multi_axis_rope", backend="cpu_strict", device="cpu", dtypes=_F32, fn=multi_axis_rope,
                    strict=True, split_k=False, kernel_name="cpu_multi_axis_rope", reduction_order="none (two products and one add per element)"))

"""CUDA strict timestep embedding MLP: the sinusoid, then both linears on the strict GEMM engine.

``timestep_embed_mlp(sigma (B,), w1 (D, C), b1 (D,), w2 (D, D), b2 (D,), *, channels=C, scale)`` →
``(B, D)`` in the weights' dtype (docs/operators.md):

* the ``[cos | sin](scale·sigma·f)`` table, ``f_i = exp(−ln(10000)·i/half)``, is computed in FP64
  (angles reach ``scale·sigma = 1000`` rad: FP32 arguments would carry ~6e-5 absolute error into
  cos/sin) and rounded once to the execution dtype. Elementwise, so a sample's row depends only on
  its own sigma;
* ``linear_1`` with the SiLU epilogue and ``linear_2`` run on :mod:`.gemm` (one row per sample,
  ``seqlens = (1,) * B``): their rows are batch-invariant and their weight gradients are per-sample
  FP32 partials folded in sample order, like every other layer on the engine.

Differentiable in the weights and biases (sigma is data, not a parameter).
"""

from __future__ import annotations

import math
import sys

import torch

from ..cpu.primitives import elementwise
from ..registry import KernelImpl, register
from .gemm import DTYPES, interpreting, gemm


def timestep_embed_mlp(
    sigma: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, *,
    channels: int, scale: float,
) -> torch.Tensor:
    """sigma (B,) FP32 → ``linear_2(SiLU(linear_1([cos | sin](scale·sigma·f))))`` (B, D), weights' dtype."""
    if not isinstance(sigma, torch.Tensor) or sigma.dim() != 1:
        raise ValueError(f"timestep_embed_mlp: expected sigma of shape (B,), got {getattr(sigma, 'shape', type(sigma).__name__)}")
    if sigma.dtype != torch.float32:
        raise ValueError(f"timestep_embed_mlp: expected float32 sigma, got {sigma.dtype}")
    if sigma.device.type != "cuda" and not (interpreting() and sigma.device.type == "cpu"):
        raise ValueError(f"the triton timestep_embed_mlp needs CUDA tensors (CPU only under TRITON_INTERPRET=1), got {sigma.device}")
    if not isinstance(channels, int) or channels < 2 or channels % 2:
        raise ValueError(f"timestep_embed_mlp: channels must be a positive even int, got {channels!r}")
    if w1.dtype not in DTYPES:
        raise ValueError(f"timestep_embed_mlp runs fp32 or bf16 weights, got {w1.dtype}")
    if w1.dim() != 2 or w1.shape[1] != channels:
        raise ValueError(f"timestep_embed_mlp: expected w1 of shape (D, {channels}), got {tuple(w1.shape)}")
    half = channels // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64, device=sigma.device) / half)
    angles = (float(scale) * sigma.double())[:, None] * freqs[None, :]
    if angles.device.type == "cpu":  # interpreter runs: CPU cos/sin switch code paths at SIMD tails
        emb = torch.cat([elementwise(torch.cos, angles), elementwise(torch.sin, angles)], dim=-1)
    else:  # a CUDA elementwise kernel evaluates every element with the same device function
        emb = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
    emb = emb.to(w1.dtype).contiguous()
    ones = (1,) * sigma.shape[0]
    h = gemm(emb, w1, b1, seqlens=ones, epilogue="silu")
    return gemm(h, w2, b2, seqlens=ones)


register(KernelImpl(
    op="timestep_embed_mlp", backend="triton", device="cuda", dtypes=frozenset(DTYPES), fn=timestep_embed_mlp,
    strict=True, split_k=False, kernel_name="fp64 sinusoid + _gemm_fwd_kernel (silu epilogue) + _gemm_fwd_kernel",
    source=sys.modules[__name__],
    config={"gemm": "mmdit_strict.kernels.triton.gemm", "sinusoid": "fp64, rounded once"},
    reduction_order="one row per sample; sinusoid elementwise in FP64 rounded once; both linears on the strict GEMM engine",
    accumulator="fp32",
))

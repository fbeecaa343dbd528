"""CPU strict GEMM engine: every linear layer of the model (docs/operators.md, GEMM family).

Math: ``y = epilogue(p(x) Wᵀ + b + scale · (p(x) Aᵀ) Bᵀ)`` in FP32.

Reduction order:
  forward / dX: K-reduction inside one fixed ``(32, K) @ (K, N)`` BLAS tile product per 32 rows
      (:func:`tile_matmul`); a row's bytes never depend on M or its tile-mates.
  dW, dA, dB: per sample ``dZ_sᵀ X_s`` (one BLAS product whose shape is the sample's own row count,
      on freshly allocated operands), then folded in sample-index order.
  db: per-sample pairwise tree over the sample's rows, then folded in sample order.
Cast points: FP32 only (the CPU strict backend is qualified for float32 execution).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..grad_sink import active as active_grad_sink
from ..prologues import prologue_pass
from ..registry import KernelImpl, register
from .primitives import (
    TILE_M, check_seqlens, fold, gelu_tanh_bwd, gelu_tanh_fwd, segment_tree_sum, silu_bwd, silu_fwd, tile_matmul,
)

PROLOGUES = ("none", "silu")
EPILOGUES = ("none", "gelu_tanh", "silu")
LoRA = tuple  # (A (r, K), B (N, r), scale)


def _per_sample_outer(dz: torch.Tensor, x: torch.Tensor, seqlens: tuple[int, ...], sink=None, param=None,
                      keys=None) -> torch.Tensor | None:
    """``sum_s dz_sᵀ x_s`` folded in sample order; each product on fresh contiguous operands.

    With a gradient sink, each sample's partial is also handed to it under the sample's key, and the sum is
    None where the sink takes no autograd sums (``SampleGradSink(autograd_sums=False)``).
    """
    parts = []
    start = 0
    for n in seqlens:
        if n == 0:
            parts.append(dz.new_zeros(dz.shape[1], x.shape[1]))
            continue
        parts.append(dz[start:start + n].t().contiguous().clone() @ x[start:start + n].contiguous().clone())
        start += n
    if sink is not None and param is not None and keys is not None:
        sink.add(param, keys, parts)
        if not sink.autograd_sums:
            return None
    acc = parts[0] if parts else dz.new_zeros(dz.shape[1], x.shape[1])
    for part in parts[1:]:
        acc = acc + part
    return acc


def check_gemm_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora: LoRA | None,
                      prologue: str, epilogue: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"expected x of shape (M, K), got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"expected weight of shape (N, {x.shape[1]}), got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"expected bias of shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if prologue not in PROLOGUES:
        raise ValueError(f"unknown prologue {prologue!r}; choose one of {PROLOGUES}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"unknown epilogue {epilogue!r}; choose one of {EPILOGUES}")
    tensors = [x, weight] + ([bias] if bias is not None else [])
    if lora is not None:
        A, Bm, _ = lora
        if A.dim() != 2 or A.shape[1] != x.shape[1] or Bm.dim() != 2 or Bm.shape != (weight.shape[0], A.shape[0]):
            raise ValueError(
                f"LoRA factors must be A (r, {x.shape[1]}) and B ({weight.shape[0]}, r), got {tuple(A.shape)} and {tuple(Bm.shape)}"
            )
        tensors += [A, Bm]
    for t in tensors:
        if t.dtype != torch.float32:
            raise ValueError(f"CPU strict GEMM runs in float32, got {t.dtype}")
        if t.device.type != "cpu":
            raise ValueError(f"CPU strict GEMM needs CPU tensors, got {t.device}")


def _prologue(x: torch.Tensor, act: str) -> torch.Tensor:
    return silu_fwd(x)  # the one prologue there is


class StrictGemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scale, seqlens, prologue, epilogue):  # type: ignore[override]
        px = prologue_pass(x, prologue, _prologue) if prologue == "silu" else x
        z = tile_matmul(px, weight.t())
        u = None
        if lora_a is not None:
            u = tile_matmul(px, lora_a.t())  # (M, r)
            z = z + scale * tile_matmul(u, lora_b.t())
        if bias is not None:
            z = z + bias
        if epilogue == "gelu_tanh":
            y = gelu_tanh_fwd(z)
        elif epilogue == "silu":
            y = silu_fwd(z)
        else:
            y = z
        ctx.save_for_backward(x, px, z if epilogue != "none" else None, weight, bias, lora_a, lora_b, u)
        ctx.meta = (scale, seqlens, prologue, epilogue)
        sink, keys = active_grad_sink()
        if sink is not None and keys is not None and len(keys) != len(seqlens):
            raise ValueError(f"sample_keys declares {len(keys)} samples but this GEMM sees {len(seqlens)}")
        ctx.sink = (sink, keys, weight, bias, lora_a, lora_b) if sink is not None and keys is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, px, z, weight, bias, lora_a, lora_b, u = ctx.saved_tensors
        scale, seqlens, prologue, epilogue = ctx.meta
        dy = dy.contiguous()
        if epilogue == "gelu_tanh":
            dz = gelu_tanh_bwd(z, dy)
        elif epilogue == "silu":
            dz = silu_bwd(z, dy)
        else:
            dz = dy
        dx = dW = db = dA = dB = None
        sink, keys, p_w, p_b, p_a, p_bb = ctx.sink if ctx.sink is not None else (None,) * 6
        need_x = ctx.needs_input_grad[0]
        dpx = tile_matmul(dz, weight) if need_x else None
        if lora_a is not None:
            du = scale * tile_matmul(dz, lora_b)  # (M, r)
            if need_x:
                dpx = dpx + tile_matmul(du, lora_a)
            if ctx.needs_input_grad[3]:
                dA = _per_sample_outer(du, px, seqlens, sink, p_a, keys)
            if ctx.needs_input_grad[4]:
                # scale is applied per sample before folding so the sink's partials equal the folded terms
                dB = _per_sample_outer(scale * dz, u, seqlens, sink, p_bb, keys)
        if need_x:
            dx = silu_bwd(x, dpx) if prologue == "silu" else dpx
        if ctx.needs_input_grad[1]:
            dW = _per_sample_outer(dz, px, seqlens, sink, p_w, keys)
        if bias is not None and ctx.needs_input_grad[2]:
            per_sample = segment_tree_sum(dz, seqlens)
            if sink is not None:
                sink.add(p_b, keys, list(per_sample))
            db = fold(per_sample) if sink is None or sink.autograd_sums else None
        return dx, dW, db, dA, dB, None, None, None, None


def gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    seqlens: Sequence[int],
    prologue: str = "none",
    epilogue: str = "none",
    lora: LoRA | None = None,
) -> torch.Tensor:
    """Batch-invariant ``epilogue(p(x) Wᵀ + b + scale·(p(x)Aᵀ)Bᵀ)``: x (M, K) fp32 → (M, N) fp32."""
    check_gemm_inputs(x, weight, bias, lora, prologue, epilogue)
    seq = check_seqlens(seqlens, x.shape[0])
    a, b_, scale = (lora[0], lora[1], float(lora[2])) if lora is not None else (None, None, 0.0)
    return StrictGemmFunction.apply(x.contiguous(), weight, bias, a, b_, scale, seq, prologue, epilogue)


_REDUCTION = "K in one fixed (32,K)@(K,N) BLAS tile per 32 rows; dW/db per-sample (own length), folded in sample order"
for _op in ("latent_proj_gemm", "qkv_bias_gemm", "attn_out_bias_gemm", "mlp_up_gemm_gelu", "mlp_down_gemm", "adaln_mod_projection"):
    register(KernelImpl(
        op=_op, backend="cpu_strict", device="cpu", dtypes=frozenset({torch.float32}), fn=gemm, strict=True, split_k=False,
        kernel_name="cpu_tile_bmm_gemm", source=StrictGemmFunction, config={"TILE_M": TILE_M},
        reduction_order=_REDUCTION,
    ))

"""CUDA strict unfused joint attention (Triton): ``joint_attn_qk_gemm``, ``joint_attn_softmax``, ``joint_attn_av_gemm``.

The three steps of one sample's attention as separate operators, for localization (docs/operators.md):

    S = joint_attn_qk_gemm(q (H, L, d), k (H, L, d))    -> (H, L, L) FP32,  S = (q kᵀ)·(1/√d)
    P = joint_attn_softmax(S (H, L, L) FP32)           -> (H, L, L) FP32
    O = joint_attn_av_gemm(P (H, L, L), v (H, L, d))    -> (H, L, d) in v's dtype (P enters the product in v's dtype)

Each call is one sample (the CPU strict backend's contract), so batch invariance holds by
construction; the tiles are fixed and anchored at row/column 0 of that sample.

Arithmetic: every product is one Triton program per output tile reducing its inner dimension in
``BLOCK_K`` steps from 0 upwards into an FP32 accumulator (bf16 operands on the tensor cores, FP32
operands as IEEE products, never TF32), then ``acc·scale`` in FP32 and one cast at the output. The
scores stay FP32 (as inside the fused kernel), so the logits are never rounded to bf16. The softmax
is row by row in three passes over ``BLOCK`` chunks from column 0: ``m = max``, ``l = Σ exp2(fma(s,
log2 e, −m·log2 e))`` (FP32, chunk sums folded in order, ``tl.sum`` within a chunk), then ``p = exp2(…)
/ l`` (IEEE division), cast once. Backward: ``dS = P ∘ (dP − rowsum(dP ∘ P))`` in FP32 (same row
passes), ``dP = dO Vᵀ``, ``dV = Pᵀ dO``, ``dq = (1/√d)·dS k``, ``dk = (1/√d)·dSᵀ q`` with the same
product kernel; ``dS`` enters the tensor cores rounded to the execution dtype.

The composition is *not* byte-equal to ``joint_attention_fused``: the fused kernel rescales an
unnormalized accumulator key tile by key tile (online softmax) and rounds the unnormalized
``P`` to the input dtype, while here ``P`` is normalized before the product. The difference is
bounded in ``tolerances.yaml`` (``attention_unfused``), measured by the tests against the FP64
reference and against the fused kernel.
"""

from __future__ import annotations

import math
import sys

import torch
import triton
import triton.language as tl

from ..registry import KernelImpl, register
from .bound import bound, cdiv
from .gemm import DTYPES, interpreting, launch_opts


@triton.jit
def _bmm_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_ah, stride_am, stride_ak, stride_bh, stride_bk, stride_bn, stride_ch, stride_cm, stride_cn,
    scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """C[h] = scale · (A[h] @ B[h]) for one (BLOCK_M, BLOCK_N) tile of head h; K ascending in BLOCK_K steps.

    Operands are cast to DOT_DTYPE before each ``tl.dot`` (FP32 accumulate); ``acc·scale`` in FP32; one
    cast to C's dtype; masked store.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_base = a_ptr + h * stride_ah + rm.to(tl.int64)[:, None] * stride_am
    b_base = b_ptr + h * stride_bh + rn.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_base + kk.to(tl.int64)[None, :] * stride_ak, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_base + kk.to(tl.int64)[:, None] * stride_bk, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    c = (acc * scale).to(c_ptr.dtype.element_ty)
    c_ptrs = c_ptr + h * stride_ch + rm.to(tl.int64)[:, None] * stride_cm + rn.to(tl.int64)[None, :] * stride_cn
    tl.store(c_ptrs, c, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _softmax_fwd_kernel(s_ptr, p_ptr, L, BLOCK: tl.constexpr):
    """One row of one head: max, then Σ exp2, then p = exp2(…)/l (three passes from column 0)."""
    base = tl.program_id(0).to(tl.int64) * L
    cols = tl.arange(0, BLOCK)
    m_vec = tl.full([BLOCK], float("-inf"), tl.float32)
    for c0 in range(0, L, BLOCK):
        s = tl.load(s_ptr + base + c0 + cols, mask=c0 + cols < L, other=float("-inf"))
        m_vec = tl.maximum(m_vec, s)
    m2 = tl.max(m_vec, 0) * 1.4426950408889634
    l_i = tl.zeros([1], tl.float32)
    for c0 in range(0, L, BLOCK):
        s = tl.load(s_ptr + base + c0 + cols, mask=c0 + cols < L, other=float("-inf"))
        l_i += tl.sum(tl.math.exp2(tl.fma(s, 1.4426950408889634, -m2)), 0)
    for c0 in range(0, L, BLOCK):
        ok = c0 + cols < L
        s = tl.load(s_ptr + base + c0 + cols, mask=ok, other=float("-inf"))
        p = tl.math.div_rn(tl.math.exp2(tl.fma(s, 1.4426950408889634, -m2)), l_i)
        tl.store(p_ptr + base + c0 + cols, p.to(p_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _softmax_bwd_kernel(p_ptr, dp_ptr, ds_ptr, L, BLOCK: tl.constexpr):
    """One row: Δ = Σ dP∘P (FP32, chunks folded from column 0), then dS = P∘(dP − Δ)."""
    base = tl.program_id(0).to(tl.int64) * L
    cols = tl.arange(0, BLOCK)
    d_i = tl.zeros([1], tl.float32)
    for c0 in range(0, L, BLOCK):
        ok = c0 + cols < L
        p = tl.load(p_ptr + base + c0 + cols, mask=ok, other=0.0).to(tl.float32)
        dp = tl.load(dp_ptr + base + c0 + cols, mask=ok, other=0.0).to(tl.float32)
        d_i += tl.sum(p * dp, 0)
    for c0 in range(0, L, BLOCK):
        ok = c0 + cols < L
        p = tl.load(p_ptr + base + c0 + cols, mask=ok, other=0.0).to(tl.float32)
        dp = tl.load(dp_ptr + base + c0 + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(ds_ptr + base + c0 + cols, (p * (dp - d_i)).to(ds_ptr.dtype.element_ty), mask=ok)


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) per execution dtype; the softmax row chunk.
CONFIGS = {torch.bfloat16: (128, 128, 64, 8, 3), torch.float32: (64, 64, 32, 4, 2)}
_INTERPRET_TILES = (16, 16, 16, 1, 1)
SOFTMAX_BLOCK = 1024
_INTERPRET_SOFTMAX_BLOCK = 16


def _opts(warps: int, stages: int) -> dict:
    return launch_opts(warps, interpreting(), num_stages=stages)


def _bmm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, dot_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """(H, M, K) @ (H, K, N) → (H, M, N) in ``out_dtype``; any strides."""
    H, M, K = a.shape
    N = b.shape[2]
    c = torch.empty((H, M, N), dtype=out_dtype, device=a.device)
    if H == 0 or M == 0 or N == 0:
        return c
    bm, bn, bk, warps, stages = _INTERPRET_TILES if interpreting() else CONFIGS[dot_dtype]
    dd = tl.bfloat16 if dot_dtype == torch.bfloat16 else tl.float32
    bound(_bmm_kernel)[(cdiv(M, bm), cdiv(N, bn), H)](
        a, b, c, M, N, K, *a.stride(), *b.stride(), *c.stride(), float(scale),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_DTYPE=dd, DOT_PRECISION="ieee", **_opts(warps, stages))
    return c


def _rows_kernel_launch(kernel, *tensors: torch.Tensor, L: int) -> None:
    rows = tensors[0].numel() // max(L, 1)
    if rows == 0 or L == 0:
        return
    block = _INTERPRET_SOFTMAX_BLOCK if interpreting() else SOFTMAX_BLOCK
    bound(kernel)[(rows,)](*tensors, L, BLOCK=block, **_opts(4, 1))


def _check(name: str, t: torch.Tensor, dims: int = 3) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        raise ValueError(f"expected {name} as a {dims}-D tensor (H, L, ...), got {getattr(t, 'shape', type(t).__name__)}")
    if t.device.type != "cuda" and not (interpreting() and t.device.type == "cpu"):
        raise ValueError(f"the triton unfused attention needs CUDA tensors (CPU only under TRITON_INTERPRET=1), got {name} on {t.device}")


def _check_pair(an: str, a: torch.Tensor, bn: str, b: torch.Tensor) -> None:
    _check(an, a)
    _check(bn, b)
    if a.dtype not in DTYPES or b.dtype != a.dtype:
        raise ValueError(f"expected {an} and {bn} of one dtype, fp32 or bf16, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"expected {an} and {bn} on one device, got {a.device} and {b.device}")


class _QK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k):
        scale = 1.0 / math.sqrt(q.shape[-1])
        ctx.save_for_backward(q, k)
        ctx.scale = scale
        return _bmm(q, k.transpose(1, 2), torch.float32, q.dtype, scale)

    @staticmethod
    def backward(ctx, ds):
        q, k = ctx.saved_tensors
        ds = ds.float()
        dq = _bmm(ds, k, q.dtype, q.dtype, ctx.scale) if ctx.needs_input_grad[0] else None
        dk = _bmm(ds.transpose(1, 2), q, k.dtype, k.dtype, ctx.scale) if ctx.needs_input_grad[1] else None
        return dq, dk


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s):
        p = torch.empty_like(s)
        _rows_kernel_launch(_softmax_fwd_kernel, s, p, L=s.shape[-1])
        ctx.save_for_backward(p)
        ctx.s_dtype = s.dtype
        return p

    @staticmethod
    def backward(ctx, dp):
        (p,) = ctx.saved_tensors
        ds = torch.empty(p.shape, dtype=ctx.s_dtype, device=p.device)
        _rows_kernel_launch(_softmax_bwd_kernel, p, dp.contiguous(), ds, L=p.shape[-1])
        return ds


class _AV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, v):
        ctx.save_for_backward(p, v)
        return _bmm(p, v, v.dtype, v.dtype, 1.0)

    @staticmethod
    def backward(ctx, do):
        p, v = ctx.saved_tensors
        dp = _bmm(do, v.transpose(1, 2), p.dtype, v.dtype, 1.0) if ctx.needs_input_grad[0] else None
        dv = _bmm(p.transpose(1, 2), do, v.dtype, v.dtype, 1.0) if ctx.needs_input_grad[1] else None
        return dp, dv


def joint_attn_qk_gemm(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One sample: q, k (H, L, d) fp32|bf16, any strides → scores (H, L, L) FP32 = (q kᵀ)·(1/√d)."""
    _check_pair("q", q, "k", k)
    if q.shape != k.shape:
        raise ValueError(f"expected q and k of one shape (H, L, d), got {tuple(q.shape)} and {tuple(k.shape)}")
    return _QK.apply(q, k)


def joint_attn_softmax(s: torch.Tensor) -> torch.Tensor:
    """Row softmax of one sample's scores (H, L, L), contiguous; result in s's dtype."""
    _check("s", s)
    if s.dtype not in DTYPES:
        raise ValueError(f"expected fp32 or bf16 scores, got {s.dtype}")
    if s.shape[1] != s.shape[2]:
        raise ValueError(f"expected square scores (H, L, L), got {tuple(s.shape)}")
    if not s.is_contiguous():
        raise ValueError(f"expected contiguous scores, got strides {tuple(s.stride())}")
    return _Softmax.apply(s)


def joint_attn_av_gemm(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One sample: probabilities (H, L, L) fp32 or v's dtype @ v (H, L, d), any strides → (H, L, d) in v's dtype.

    FP32 probabilities are rounded to v's dtype as they enter the product (the one cast point of P).
    """
    _check("p", p)
    _check("v", v)
    if v.dtype not in DTYPES or p.dtype not in (torch.float32, v.dtype):
        raise ValueError(f"expected v fp32 or bf16 and p fp32 or v's dtype, got p {p.dtype}, v {v.dtype}")
    if p.device != v.device:
        raise ValueError(f"expected p and v on one device, got {p.device} and {v.device}")
    if p.shape[0] != v.shape[0] or p.shape[1] != p.shape[2] or p.shape[2] != v.shape[1]:
        raise ValueError(f"expected p (H, L, L) and v (H, L, d), got {tuple(p.shape)} and {tuple(v.shape)}")
    return _AV.apply(p, v)


_ORDER = ("one sample per call; products: one program per output tile, inner dimension in BLOCK_K steps from 0, "
          "FP32 accumulate, scale in FP32, one cast; softmax: per row three passes over 1024-column chunks from column 0 "
          "(max, FP32 sum of exp2, divide); scores kept FP32")
for _op, _fn in (("joint_attn_qk_gemm", joint_attn_qk_gemm), ("joint_attn_softmax", joint_attn_softmax),
                 ("joint_attn_av_gemm", joint_attn_av_gemm)):
    register(KernelImpl(
        op=_op, backend="triton", device="cuda", dtypes=frozenset(DTYPES), fn=_fn, strict=True, split_k=False,
        kernel_name={"joint_attn_softmax": "_softmax_fwd_kernel/_softmax_bwd_kernel"}.get(_op, "_bmm_kernel"),
        source=sys.modules[__name__],
        config={"bmm": {str(k).replace("torch.", ""): list(v) for k, v in CONFIGS.items()}, "softmax_block": SOFTMAX_BLOCK,
                "dot_precision": "ieee", "fp_fusion": False},
        reduction_order=_ORDER, accumulator="fp32",
    ))

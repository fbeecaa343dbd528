"""Strict GEMM engine (Triton): every linear layer of the model, forward and backward.

One engine serves the six GEMM-family operators (``latent_proj_gemm``, ``qkv_bias_gemm``,
``attn_out_bias_gemm``, ``mlp_up_gemm_gelu``, ``mlp_down_gemm``, ``adaln_mod_projection``) with the
call contract of ``docs/operators.md``::

    y = epilogue(p(x) Wᵀ + b + scale · (p(x) Aᵀ) Bᵀ)        x (M, K), W (N, K), b (N,), A (r, K), B (N, r)

Arithmetic (docs/design.md §3), frozen here and documented per kernel below:

* Tiles are chosen from ``(N, K, dtype)`` only (``configs.py``), never from M. Each output element
  is reduced by one program over K in ``BLOCK_K`` steps from k = 0 upwards, each step one ``tl.dot``
  into an FP32 accumulator: no split-K, no stream-K, no atomics. A row's bytes therefore depend only
  on that row, W and the configuration — not on M, its position in a tile, or its neighbours.
* BF16 operands run on the tensor cores with FP32 accumulation; FP32 operands use
  ``input_precision="ieee"`` (true FP32 FMA, never TF32).
* Epilogue in FP32 on the accumulator, then **one cast** to the execution dtype at the output.
  ``exp`` is a range-reduced polynomial written with IEEE ``+ - *`` and explicit ``fma`` (no
  ``ex2.approx``/``__expf``), divisions are Newton iterations in ``fma`` from an integer first
  guess with a final residual correction (no ``rcp.approx``/``div.full``), and kernels are compiled with
  ``enable_fp_fusion=False`` so no multiply-add is contracted: every epilogue operation is one
  IEEE-rounded FP32 operation, in the order written. The interpreter (numpy FP32) executes the same
  sequence.
* Backward: ``dZ = dY · epilogue'(Z)`` (elementwise), ``dX = dZ W`` by the same main kernel (W read
  as stored, ``(N, K)`` row-major), ``dW = Σ_s Σ_{rows of s} dZᵀ p(x)``, ``db = Σ_s Σ_rows dZ``: each
  sample s reduced over its own rows in ``BLOCK_M`` chunks from its first row (a tree that depends
  only on that sample's row count), the per-sample FP32 partials folded left in sample order
  (``acc = 0 + P_0; acc = acc + P_1; ...``), cast once. LoRA gradients use the same kernels.

Cast points (the only roundings to the execution dtype): the output ``y``; the saved pre-activation
``Z`` (when an epilogue is set and a gradient is needed); ``p(x)`` entering the tensor cores (BF16 only;
``silu`` is evaluated in FP32 from the stored x and rounded once, exactly as an unfused
``silu(x).to(dtype)`` would be); the LoRA intermediate ``u = p(x) Aᵀ`` (the engine's own output cast);
``dZ``; and each gradient output.

Weight layout: the forward reads the weight either as a prepacked contiguous ``Wᵀ (K, N)``
(:func:`prepacked_weight`, cached per weight tensor and ``_version``) or through strides in
nn.Linear's ``(N, K)`` layout, as ``configs.FWD[...]["weight_layout"]`` says for the shape class.
The prepacked copy doubles that weight's memory; :func:`clear_prepack_cache` drops the cache.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref

import torch
import triton
import triton.language as tl

from ..keepalive import retain
from ..registry import KernelImpl, register
from . import configs as _configs

# ----------------------------------------------------------------------------------------------
# Scalar helpers (FP32, IEEE operations only)
# ----------------------------------------------------------------------------------------------

# The kernels write their constants as literals (a jit function reads no Python globals):
# log2(e) = 1.4426950408889634; ln2 = 0.693145751953125 (hi, 0x3f317200: n·hi is exact for |n| < 2⁹)
# + 1.428606765330187045e-06 (lo); GELU 2·√(2/π) = 1.5957691216057308, a = 0.044715, 3a = 0.134145.


@triton.jit
def _exp_clamped_f32(x):
    """exp(clamp(x, −86, 86)) in FP32 from IEEE operations only (``+ - *``, the fused multiply-add
    ``fma``, integer bit operations): the ``e`` of the activations' denominators ``1 + e``.

    k = fma(x, log2e, 1.5·2²³) rounds x·log2e to the nearest integer n in its low mantissa bits
    (n = k − 1.5·2²³, exact; no float-to-int conversion); r = fma(n, −ln2_hi, x); r = fma(n, −ln2_lo, r)
    (Cody–Waite, |r| ≤ 0.35); exp(r) by the degree-7 Taylor polynomial in Horner form, one ``fma``
    per degree (truncation < 0.1 ulp); times 2ⁿ, built from k's bits (n in [−124, 124]: the product
    is a normal number, exact). The clamp: below −86, 1 + e rounds to 1 anyway; the upper
    bound keeps 1 + e < 2¹²⁵, the range of :func:`_div_ge1_f32` (for GELU that is z < −9.8 and for
    SiLU z < −86, where the activation is below 2⁻¹²⁴·|z| in magnitude). ``fma`` is IEEE 754's
    fusedMultiplyAdd (one rounding), written explicitly: it is not a contraction (kernels compile
    with ``enable_fp_fusion=False``) and not an approximate intrinsic.
    """
    x = tl.minimum(tl.maximum(x, -86.0), 86.0)
    k = tl.fma(x, 1.4426950408889634, 12582912.0)
    n = k - 12582912.0
    r = tl.fma(n, -0.693145751953125, x)
    r = tl.fma(n, -1.428606765330187045e-06, r)
    p = tl.fma(r, 1.0 / 5040.0, 1.0 / 720.0)
    p = tl.fma(p, r, 1.0 / 120.0)
    p = tl.fma(p, r, 1.0 / 24.0)
    p = tl.fma(p, r, 1.0 / 6.0)
    p = tl.fma(p, r, 0.5)
    p = tl.fma(p, r, 1.0)
    p = tl.fma(p, r, 1.0)
    # bits(k) = 0x4B400000 + n, so (bits(k) − 0x4B400000 + 127) << 23 is the exponent field of 2ⁿ
    return p * ((k.to(tl.int32, bitcast=True) - 1262485377) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _div_ge1_f32(n, d):
    """n / d for 1 ≤ d < 2¹²⁵ from IEEE ``- * fma`` and one integer subtraction: no ``rcp.approx``, no
    ``div.full`` and no ``div.rn`` (whose out-of-line slow path made the GELU epilogue spill registers
    on the H200: 255 registers / 18 spilled vs 200 / 0, experiments/gemm/NOTES.md round 4).

    y₀ = bits⁻¹(0x7EF311C3 − bits(d)) (|y₀·d − 1| < 0.13), three Newton steps
    y = fma(fma(−d, y, 1), y, y) (|y·d − 1| ≤ 6e-8), then q = n·y and one residual correction
    q = fma(−fma(d, q, −n), y, q). Equal to the correctly rounded quotient on every pair tested
    (12·10⁶ random pairs with d in [1, e⁸⁰]; the CI test checks 65 536 in the interpreter). The
    callers keep d < 2¹²⁵ (beyond it y₀ would be subnormal); a non-finite n gives NaN.
    """
    y = (2129859011 - d.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)  # 0x7EF311C3
    y = tl.fma(tl.fma(-d, y, 1.0), y, y)
    y = tl.fma(tl.fma(-d, y, 1.0), y, y)
    y = tl.fma(tl.fma(-d, y, 1.0), y, y)
    q = n * y
    return tl.fma(-tl.fma(d, q, -n), y, q)  # residual n − d·q as −(d·q − n): keeps the sign of a zero n


@triton.jit
def _sigmoid_f32(t):
    """σ(t) = 1 / (1 + exp(−t)), the division by :func:`_div_ge1_f32`."""
    one = tl.full(t.shape, 1.0, tl.float32)
    return _div_ge1_f32(one, one + _exp_clamped_f32(-t))


@triton.jit
def _act_f32(z, ACT: tl.constexpr):
    """ACT 1: gelu_tanh(z) = z / (1 + exp(−t)), t = 2c·fma(z³, a, z) (= ½z(1 + tanh(c(z + a z³))),
    c = √(2/π), a = 0.044715); ACT 2: silu(z) = z / (1 + exp(−z)). One division (:func:`_div_ge1_f32`)
    of z by 1 + exp(−t) — the same function as z·σ(t) with one rounding fewer. Operation order as
    written; every step one IEEE FP32 rounding."""
    if ACT == 1:
        t = tl.fma((z * z) * z, 0.044715, z) * 1.5957691216057308
        return _div_ge1_f32(z, 1.0 + _exp_clamped_f32(-t))
    else:
        return _div_ge1_f32(z, 1.0 + _exp_clamped_f32(-z))


@triton.jit
def _act_grad_f32(z, ACT: tl.constexpr):
    """d act / dz.  gelu_tanh: s + z·s·(1−s)·2c(1 + 3a z²) with s = σ(2c(z + a z³));
    silu: s·(1 + z·(1 − s)) with s = σ(z)."""
    if ACT == 1:
        t = tl.fma((z * z) * z, 0.044715, z) * 1.5957691216057308
        s = _sigmoid_f32(t)
        dt = tl.fma(z * z, 0.134145, 1.0) * 1.5957691216057308
        return s + ((z * s) * (1.0 - s)) * dt
    else:
        s = _sigmoid_f32(z)
        return s * (z * (1.0 - s) + 1.0)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _grouped_tile(tile, num_a, num_b, GROUP: tl.constexpr):
    """Tile ``tile`` of a (num_a, num_b) grid in grouped order (GROUP rows of a per column sweep, for
    L2 reuse). Moves no arithmetic: it only decides which program computes which tile."""
    group_size = GROUP * num_b
    first = (tile // group_size) * GROUP
    in_group = tl.minimum(num_a - first, GROUP)
    return first + (tile % group_size) % in_group, (tile % group_size) // in_group


@triton.jit
def _fwd_tile_acc(
    a_ptr, b_ptr, bias_ptr, u_ptr, l_ptr, pid_m, pid_n, M, N, K, R,
    stride_am, stride_bk, stride_bn, stride_um, stride_lr, stride_ln, lora_scale,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, USE_TMA: tl.constexpr,
):
    """FP32 tile ``p(a) @ b (+ bias) (+ lora_scale · u @ l)`` of output tile (pid_m, pid_n)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    if not USE_TMA:
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + offs_k[:, None].to(tl.int64) * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        if USE_TMA:
            a = a_ptr.load([pid_m * BLOCK_M, k0 * BLOCK_K])
            b = b_ptr.load([k0 * BLOCK_K, pid_n * BLOCK_N])
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            k_left = K - k0 * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if PROLOGUE == 1:
            a = _act_f32(a.to(tl.float32), 2).to(a_ptr.dtype.element_ty)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if not USE_TMA:
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bk

    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    if HAS_LORA:
        offs_r = tl.arange(0, BLOCK_R)
        lacc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, tl.cdiv(R, BLOCK_R)):
            r_left = R - r0 * BLOCK_R
            u = tl.load(u_ptr + rows[:, None] * stride_um + (r0 * BLOCK_R + offs_r)[None, :],
                        mask=mask_m[:, None] & (offs_r[None, :] < r_left), other=0.0)
            lw = tl.load(l_ptr + (r0 * BLOCK_R + offs_r)[:, None] * stride_lr
                         + offs_n[None, :].to(tl.int64) * stride_ln,
                         mask=(offs_r[:, None] < r_left) & mask_n[None, :], other=0.0)
            lacc = tl.dot(u, lw, lacc, input_precision=DOT_PRECISION)
        acc = acc + lacc * lora_scale
    return acc


@triton.jit
def _fwd_store_part(
    acc, m0, n0, M, N, aux_ptr, out_ptr, pre_ptr, out_desc, stride_auxm, stride_om,
    EPILOGUE: tl.constexpr, STORE_PRE: tl.constexpr, TMA_STORE: tl.constexpr,
    BLOCK_M: tl.constexpr, PART_N: tl.constexpr,
):
    """Epilogue of one (BLOCK_M, PART_N) column part of a tile at (m0, n0): [pre store], activation,
    one cast, store. Elementwise: how a tile is cut into parts moves no arithmetic."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, PART_N)
    rows = offs_m.to(tl.int64)
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out_offs = rows[:, None] * stride_om + offs_n[None, :]
    if STORE_PRE:
        tl.store(pre_ptr + out_offs, acc.to(pre_ptr.dtype.element_ty), mask=out_mask)
    if EPILOGUE == 1:
        acc = _act_f32(acc, 1)
    elif EPILOGUE == 2:
        acc = _act_f32(acc, 2)
    elif EPILOGUE == 3:
        xa = tl.load(aux_ptr + rows[:, None] * stride_auxm + offs_n[None, :], mask=out_mask, other=0.0)
        acc = acc * _act_grad_f32(xa.to(tl.float32), 2)
    if TMA_STORE:
        out_desc.store([m0, n0], acc.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _halves(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Column halves ``x[:, :COLS//2], x[:, COLS//2:]`` of a (ROWS, COLS) tile (no arithmetic)."""
    return tl.split(tl.permute(tl.reshape(x, (ROWS, 2, COLS // 2)), (0, 2, 1)))


@triton.jit
def _fwd_tile_store(
    acc, pid_m, pid_n, M, N, aux_ptr, out_ptr, pre_ptr, out_desc, stride_auxm, stride_om,
    EPILOGUE: tl.constexpr, STORE_PRE: tl.constexpr, TMA_STORE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPI_SPLIT: tl.constexpr,
):
    """Epilogue of a whole tile in EPI_SPLIT column parts (1, 2 or 4): fewer live registers per part."""
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    if EPI_SPLIT == 1:
        _fwd_store_part(acc, m0, n0, M, N, aux_ptr, out_ptr, pre_ptr, out_desc, stride_auxm, stride_om,
                        EPILOGUE, STORE_PRE, TMA_STORE, BLOCK_M, BLOCK_N)
    elif EPI_SPLIT == 2:
        h0, h1 = _halves(acc, BLOCK_M, BLOCK_N)
        _fwd_store_part(h0, m0, n0, M, N, aux_ptr, out_ptr, pre_ptr, out_desc, stride_auxm, stride_om,
                        EPILOGUE, STORE_PRE, TMA_STORE, BLOCK_M, BLOCK_N // 2)
        _fwd_store_part(h1, m0, n0 + BLOCK_N // 2, M, N, aux_ptr, out_ptr, pre_ptr, out_desc, stride_auxm,
                        stride_om, EPILOGUE, STORE_PRE, TMA_STORE, BLOCK_M, BLOCK_N // 2)
    else:
        h0, h1 = _halves(acc, BLOCK_M, BLOCK_N)
        q0, q1 = _halves(h0, BLOCK_M, BLOCK_N // 2)
        q2, q3 = _halves(h1, BLOCK_M, BLOCK_N // 2)
        PART: tl.constexpr = BLOCK_N // 4
        _fwd_store_part(q0, m0, n0, M, N, aux_ptr, out_ptr, pre_ptr, out_desc, stride_auxm, stride_om,
                        EPILOGUE, STORE_PRE, TMA_STORE, BLOCK_M, PART)
        _fwd_store_part(q1, m0, n0 + PART, M, N, aux_ptr, out_ptr, pre_ptr, out_desc, stride_auxm, stride_om,
                        EPILOGUE, STORE_PRE, TMA_STORE, BLOCK_M, PART)
        _fwd_store_part(q2, m0, n0 + 2 * PART, M, N, aux_ptr, out_ptr, pre_ptr, out_desc, stride_auxm,
                        stride_om, EPILOGUE, STORE_PRE, TMA_STORE, BLOCK_M, PART)
        _fwd_store_part(q3, m0, n0 + 3 * PART, M, N, aux_ptr, out_ptr, pre_ptr, out_desc, stride_auxm,
                        stride_om, EPILOGUE, STORE_PRE, TMA_STORE, BLOCK_M, PART)


@triton.jit(do_not_specialize=["M"])
def _gemm_fwd_kernel(
    a_ptr, b_ptr, bias_ptr, u_ptr, l_ptr, aux_ptr, out_ptr, pre_ptr, out_desc,
    M, N, K, R,
    stride_am, stride_bk, stride_bn, stride_um, stride_lr, stride_ln, stride_auxm, stride_om,
    lora_scale,
    PROLOGUE: tl.constexpr, EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
    STORE_PRE: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, USE_TMA: tl.constexpr = False, TMA_STORE: tl.constexpr = False,
    EPI_SPLIT: tl.constexpr = 1, NUM_PROGRAMS: tl.constexpr = 0,
):
    """out(M, N) = epi(p(a)(M, K) @ b(K, N) + bias + lora_scale · u(M, R) @ l(R, N)).

    Reduction: acc = 0; for k0 = 0, BLOCK_K, 2·BLOCK_K, … < K: acc = dot(p(a)[:, k0:k0+BK], b[k0:k0+BK], acc)
    (one program owns a (BLOCK_M, BLOCK_N) output tile and its whole K range). FP32 (ieee) dots are
    one FMA chain over all of K per element. (``acc + dot(a, b)`` with a fresh accumulator is folded
    back into ``dot(a, b, acc)`` by Triton's combiner — measured on the H200: identical bytes — so a
    two-level FP32 sum needs another formulation; see experiments/gemm/NOTES.md.) LoRA: a second FP32
    accumulator over R in BLOCK_R steps, same form. Then, in FP32: acc = acc + bias; acc = acc +
    lora_scale · lacc; [pre = acc, stored with one cast]; out = epi(acc) stored with one cast.
    PROLOGUE 1: p = silu, in FP32 on the loaded a tile, rounded once to a's dtype before the dot.
    EPILOGUE 0 none, 1 gelu_tanh, 2 silu, 3 multiply by silu'(aux) (the prologue's backward).
    Masked rows/columns load 0 and are never stored; the grouped tile order moves no arithmetic.
    M is not specialized (``do_not_specialize``): one compiled kernel serves every M.
    USE_TMA (Hopper, ``configs`` per shape class): ``a_ptr``/``b_ptr`` are host tensor descriptors
    and the tiles arrive by the bulk tensor copy engine (out-of-range elements read as 0, exactly
    what the masked loads give); the dot sequence, hence the arithmetic, is the same. TMA_STORE:
    the output leaves through ``out_desc`` (rows past M are clipped by the copy engine).
    EPI_SPLIT: the epilogue runs on 1, 2 or 4 column parts of the tile (elementwise: same bytes).
    NUM_PROGRAMS > 0: persistent — that many programs walk the tiles (tile t, t + NUM_PROGRAMS, …) in
    one flattened loop, so the copy engine fetches the next tile's operands during this tile's
    epilogue; every tile is computed exactly as by its own program.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if NUM_PROGRAMS > 0:
        tile_c = pid - NUM_PROGRAMS  # separate counter for the epilogue, as the pipeliner prefers
        for tile in tl.range(pid, num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
            pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
            acc = _fwd_tile_acc(a_ptr, b_ptr, bias_ptr, u_ptr, l_ptr, pid_m, pid_n, M, N, K, R,
                                stride_am, stride_bk, stride_bn, stride_um, stride_lr, stride_ln, lora_scale,
                                PROLOGUE, HAS_BIAS, HAS_LORA, EVEN_K, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
                                BLOCK_R, USE_TMA)
            tile_c += NUM_PROGRAMS
            pid_m_c, pid_n_c = _grouped_tile(tile_c, num_pid_m, num_pid_n, GROUP_M)
            _fwd_tile_store(acc, pid_m_c, pid_n_c, M, N, aux_ptr, out_ptr, pre_ptr, out_desc, stride_auxm,
                            stride_om, EPILOGUE, STORE_PRE, TMA_STORE, BLOCK_M, BLOCK_N, EPI_SPLIT)
    else:
        pid_m, pid_n = _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)
        acc = _fwd_tile_acc(a_ptr, b_ptr, bias_ptr, u_ptr, l_ptr, pid_m, pid_n, M, N, K, R,
                            stride_am, stride_bk, stride_bn, stride_um, stride_lr, stride_ln, lora_scale,
                            PROLOGUE, HAS_BIAS, HAS_LORA, EVEN_K, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
                            BLOCK_R, USE_TMA)
        _fwd_tile_store(acc, pid_m, pid_n, M, N, aux_ptr, out_ptr, pre_ptr, out_desc, stride_auxm, stride_om,
                        EPILOGUE, STORE_PRE, TMA_STORE, BLOCK_M, BLOCK_N, EPI_SPLIT)


@triton.jit(do_not_specialize=["S"])
def _gemm_dw_kernel(
    g_ptr, x_ptr, starts_ptr, init_ptr, out_ptr,
    N, K, S,
    stride_gm, stride_xm,
    scale,
    PROLOGUE: tl.constexpr, HAS_INIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_N: tl.constexpr,
):
    """out(N, K) = fold_s [ scale · Σ_{rows of sample s} g[rows]ᵀ p(x)[rows] ].

    Per sample s (rows starts[s] .. starts[s+1]): part = 0; for m0 = starts[s], +BLOCK_M, … :
    part = dot(g[m0:m0+BM]ᵀ, p(x)[m0:m0+BM], part) — the chunking starts at the sample's own first
    row, so the tree depends only on its row count. Fold: acc = init (or 0); for s = 0..S−1:
    acc = acc + scale·part (two IEEE FP32 operations; scale = 1 is exact). One cast at the store.
    ``init`` lets a caller continue a fold across micro-batches in an FP32 buffer.
    """
    pid_n, pid_k = _grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(K, BLOCK_K), GROUP_N)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_k = offs_k < K
    out_mask = mask_n[:, None] & mask_k[None, :]
    out_offs = offs_n[:, None].to(tl.int64) * K + offs_k[None, :]

    if HAS_INIT:
        acc = tl.load(init_ptr + out_offs, mask=out_mask, other=0.0)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for s in range(0, S):
        start = tl.load(starts_ptr + s)
        end = tl.load(starts_ptr + s + 1)
        part = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + offs_m
            mask_m = rows < end
            rows64 = rows.to(tl.int64)
            g = tl.load(g_ptr + rows64[:, None] * stride_gm + offs_n[None, :],
                        mask=mask_m[:, None] & mask_n[None, :], other=0.0)
            x = tl.load(x_ptr + rows64[:, None] * stride_xm + offs_k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            if PROLOGUE == 1:
                x = _act_f32(x.to(tl.float32), 2).to(x_ptr.dtype.element_ty)
            part = tl.dot(tl.trans(g), x, part, input_precision=DOT_PRECISION)
        acc = acc + part * scale
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["S"])
def _gemm_db_kernel(
    g_ptr, starts_ptr, init_ptr, out_ptr,
    N, S, stride_gm,
    HAS_INIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """out(N) = fold_s [ Σ_{rows of sample s} g[rows] ].

    Per sample: part = 0; for m0 = starts[s], +BLOCK_M, …: part = part + tl.sum(g[m0:m0+BM], axis 0)
    (a fixed in-chunk tree, chunks chained in row order from the sample's first row). Fold:
    acc = init (or 0); acc = acc + part per sample in order. One cast at the store.
    """
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    if HAS_INIT:
        acc = tl.load(init_ptr + offs_n, mask=mask_n, other=0.0)
    else:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(0, S):
        start = tl.load(starts_ptr + s)
        end = tl.load(starts_ptr + s + 1)
        part = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for m0 in range(start, end, BLOCK_M):
            rows = (m0 + offs_m).to(tl.int64)
            g = tl.load(g_ptr + rows[:, None] * stride_gm + offs_n[None, :],
                        mask=((m0 + offs_m) < end)[:, None] & mask_n[None, :], other=0.0)
            part = part + tl.sum(g.to(tl.float32), axis=0)
        acc = acc + part
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit(do_not_specialize=["n_elements"])
def _act_bwd_kernel(dy_ptr, z_ptr, dz_ptr, n_elements, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """dz = dy · act'(z), elementwise in FP32, one cast at the store."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dz_ptr + offs, (dy * _act_grad_f32(z, ACT)).to(dz_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_elements"])
def _act_fwd_kernel(x_ptr, h_ptr, n_elements, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """h = act(x), elementwise in FP32, one cast at the store: the GEMM prologue as its own pass.

    Exactly the in-kernel prologue's operations (``_act_f32`` on the loaded value, one cast), so
    ``gemm(silu-prologue)`` through this pass gives the same bytes as the fused prologue while each
    element is evaluated once instead of once per output-column tile.
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(h_ptr + offs, _act_f32(x, ACT).to(h_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Host functions
# ----------------------------------------------------------------------------------------------

PROLOGUES = {"none": 0, "silu": 1}
EPILOGUES = {"none": 0, "gelu_tanh": 1, "silu": 2}
_DTYPES = (torch.float32, torch.bfloat16)
_DB_BLOCK_N = 128
_DB_BLOCK_M = 32
_ACT_BLOCK = 1024
_DOT_PRECISION = "ieee"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _launch_opts(cfg: dict) -> dict:
    if _interpreting():
        return {}
    return {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], "enable_fp_fusion": False}


def _pow2_at_least(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(max(int(n), 1)))


_PREPACK: dict[int, tuple] = {}


def prepacked_weight(weight: torch.Tensor) -> torch.Tensor:
    """Contiguous ``Wᵀ (K, N)`` copy of an nn.Linear weight ``(N, K)``, cached.

    The cache is keyed by the tensor's identity and checked against its ``_version`` and data
    pointer, so an in-place update (optimizer step, ``load_state_dict``) repacks on the next call; the
    entry is dropped when the weight is garbage-collected. Pass the same weight tensor every call
    (e.g. concatenate q/k/v once at load time): a fresh tensor each call repacks each call.
    """
    key = id(weight)
    hit = _PREPACK.get(key)
    if hit is not None and hit[0]() is weight and hit[1] == weight._version and hit[2] == weight.data_ptr():
        return hit[3]
    packed = weight.detach().t().contiguous()
    ref = weakref.ref(weight, lambda _r, k=key: _PREPACK.pop(k, None))
    _PREPACK[key] = (ref, weight._version, weight.data_ptr(), packed)
    return packed


def clear_prepack_cache() -> None:
    """Drop every prepacked weight copy (they are rebuilt on demand)."""
    _PREPACK.clear()


_STARTS: dict[tuple, torch.Tensor] = {}


def _starts(seqlens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    key = (seqlens, str(device))
    t = _STARTS.get(key)
    if t is None:
        offs = [0]
        for n in seqlens:
            offs.append(offs[-1] + n)
        t = torch.tensor(offs, dtype=torch.int32, device=device)
        if len(_STARTS) > 4096:
            _STARTS.clear()
        _STARTS[key] = t
    return retain(t)


def _check_tensor(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"expected {name} to be a tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = "(" + ", ".join("?" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"expected {name} of shape {want}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"expected {name} of dtype {dtype} (the execution dtype), got {t.dtype}")
    if t.device != device:
        raise ValueError(f"expected {name} on {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"expected {name} to be contiguous (row-major), got strides {tuple(t.stride())}")


def check_inputs(x, weight, bias, seqlens, prologue, epilogue, lora) -> None:
    """Validate a GEMM-family call (docs/operators.md); raises ValueError with the reason."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"expected x of shape (M, K), got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"strict GEMM runs fp32 or bf16, got x of dtype {x.dtype}")
    if x.device.type != "cuda" and not (_interpreting() and x.device.type == "cpu"):
        raise ValueError(f"the triton GEMM backend needs CUDA tensors (CPU only under TRITON_INTERPRET=1), got {x.device}")
    m, k = x.shape
    _check_tensor("x", x, (m, k), x.dtype, x.device)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"expected weight of shape (N, {k}), got {getattr(weight, 'shape', type(weight).__name__)}")
    n = weight.shape[0]
    _check_tensor("weight", weight, (n, k), x.dtype, x.device)
    if bias is not None:
        _check_tensor("bias", bias, (n,), x.dtype, x.device)
    if not isinstance(seqlens, tuple) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seqlens):
        raise ValueError(f"expected seqlens as a tuple of non-negative Python ints, got {seqlens!r}")
    if sum(seqlens) != m:
        raise ValueError(f"seqlens sum to {sum(seqlens)} but x has {m} rows")
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {tuple(PROLOGUES)}, got {prologue!r}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {tuple(EPILOGUES)}, got {epilogue!r}")
    if lora is not None:
        if not (isinstance(lora, tuple) and len(lora) == 3):
            raise ValueError("lora must be None or a tuple (A (r, K), B (N, r), scale)")
        a, b, scale = lora
        if not isinstance(a, torch.Tensor) or a.dim() != 2:
            raise ValueError(f"expected lora A of shape (r, {k}), got {getattr(a, 'shape', type(a).__name__)}")
        r = a.shape[0]
        if r < 1:
            raise ValueError("lora rank must be at least 1")
        _check_tensor("lora A", a, (r, k), x.dtype, x.device)
        _check_tensor("lora B", b, (n, r), x.dtype, x.device)
        if not isinstance(scale, (int, float)) or isinstance(scale, bool):
            raise ValueError(f"lora scale must be a Python float, got {type(scale).__name__}")


def _main(a, b, b_strides, n_out, *, prologue=0, epilogue=0, bias=None, lora_u=None, lora_l=None,
          lora_l_strides=(0, 0), lora_scale=1.0, aux=None, store_pre=False, out_dtype=None):
    """Launch the main kernel: ``out (M, n_out) = epi(p(a) (M, K) @ b (K, n_out) + …)``."""
    m, k = a.shape
    out_dtype = out_dtype or a.dtype
    out = torch.empty((m, n_out), dtype=out_dtype, device=a.device)
    pre = torch.empty((m, n_out), dtype=out_dtype, device=a.device) if store_pre else None
    if m == 0 or n_out == 0:
        return out, pre
    if k == 0:
        raise ValueError("the strict GEMM engine needs K >= 1")
    cfg = _configs.fwd_config(n_out, k, a.dtype)
    bn = min(cfg["BLOCK_N"], _pow2_at_least(n_out))
    bk = min(cfg["BLOCK_K"], _pow2_at_least(k))
    r = lora_u.shape[1] if lora_u is not None else 0
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n_out, bn)
    nprog = _num_programs(a.device) if cfg.get("persistent") else 0
    grid = (min(tiles, nprog) if nprog else tiles,)
    dummy = out
    use_tma = _use_tma(cfg, a, b, b_strides, bk, bn, prologue)
    split = cfg.get("epi_split", 1)
    split = split if bn % (16 * split) == 0 else 1  # parts narrower than 16 columns: one part
    tma_store = use_tma and cfg.get("tma_store", False) and (n_out * out.element_size()) % 16 == 0
    a_arg, b_arg, out_desc = a, b, dummy
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        _ensure_cuda_context(a.device)

        a_arg = TensorDescriptor(a, [m, k], [a.stride(0), 1], [cfg["BLOCK_M"], bk])
        b_arg = TensorDescriptor(b, [k, n_out], [b_strides[0], 1], [bk, bn])
        if tma_store:
            out_desc = TensorDescriptor(out, [m, n_out], [out.stride(0), 1], [cfg["BLOCK_M"], bn // split])
    global last_fwd_kernel
    last_fwd_kernel = _gemm_fwd_kernel[grid](
        a_arg, b_arg, bias if bias is not None else dummy, lora_u if lora_u is not None else dummy,
        lora_l if lora_l is not None else dummy, aux if aux is not None else dummy, out,
        pre if pre is not None else dummy, out_desc,
        m, n_out, k, r,
        a.stride(0), b_strides[0], b_strides[1],
        lora_u.stride(0) if lora_u is not None else 0, lora_l_strides[0], lora_l_strides[1],
        aux.stride(0) if aux is not None else 0, out.stride(0),
        float(lora_scale),
        PROLOGUE=prologue, EPILOGUE=epilogue, HAS_BIAS=bias is not None, HAS_LORA=lora_u is not None,
        STORE_PRE=store_pre, EVEN_K=(k % bk == 0), DOT_PRECISION=_DOT_PRECISION,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=bn, BLOCK_K=bk, BLOCK_R=min(64, _pow2_at_least(r)),
        GROUP_M=cfg["GROUP_M"], USE_TMA=use_tma, TMA_STORE=tma_store, EPI_SPLIT=split, NUM_PROGRAMS=nprog, **_launch_opts(cfg),
    )
    return out, pre


_CTX = threading.local()
last_fwd_kernel = None  # the compiled kernel of the latest forward launch (benchmarks read n_regs / n_spills)
_INTERPRETER_PROGRAMS = 3  # persistent programs under the interpreter: several tiles per program


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM (the tile loop keeps each SM busy)."""
    if device.type != "cuda":
        return _INTERPRETER_PROGRAMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _ensure_cuda_context(device: torch.device) -> None:
    """Make the device's primary CUDA context current on this thread before a tensor map is encoded.

    The host-side descriptor is encoded through the driver (``cuTensorMapEncodeTiled``) before
    Triton's launcher binds a context, and autograd runs backward on its own device threads where no
    driver context may be current yet: on the H200 (Triton 3.6) the first dX of a layer without an
    epilogue failed with "Failed to create tensor map descriptor: invalid device context". This does
    what Triton's launcher does (``cuCtxGetCurrent``; if none, retain and set the primary context),
    once per thread and device.
    """
    idx = device.index if device.index is not None else torch.cuda.current_device()
    done = getattr(_CTX, "devices", None)
    if done is None:
        done = _CTX.devices = set()
    if idx in done:
        return
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    cur = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(cur)) != 0:
        raise RuntimeError("cuCtxGetCurrent failed")
    if not cur.value:
        dev = ctypes.c_int()
        ctx = ctypes.c_void_p()
        if (lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(idx)) != 0
                or lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0 or lib.cuCtxSetCurrent(ctx) != 0):
            raise RuntimeError(f"could not make the primary CUDA context of device {idx} current")
    done.add(idx)


def _use_tma(cfg, a, b, b_strides, bk, bn, prologue) -> bool:
    """Tensor-descriptor loads when the shape class asks for them and the copy engine can serve the
    operands (CUDA, Hopper or newer, 16-byte aligned bases and row strides, unit inner stride, no
    fused prologue). Falls back to pointer loads otherwise; the arithmetic is the same either way."""
    if not cfg.get("tma") or _interpreting() or prologue or a.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(a.device)[0] < 9 or b_strides[1] != 1:
        return False
    es = a.element_size()
    return (a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0 and (a.stride(0) * es) % 16 == 0
            and (b_strides[0] * es) % 16 == 0 and a.stride(1) == 1 and bk * es >= 16 and bn * es >= 16)


def gemm_dw(g: torch.Tensor, x: torch.Tensor, seqlens: tuple[int, ...], *, prologue: str = "none",
            scale: float = 1.0, accumulate_into: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-sample weight gradient ``Σ_s scale · g[s]ᵀ p(x[s])``, folded in sample order.

    Args:
        g: (M, N) upstream gradient of the pre-activation, execution dtype.
        x: (M, K) layer input (pre-prologue), same dtype.
        seqlens: rows per sample, sum M.
        accumulate_into: optional (N, K) FP32 buffer holding an earlier fold; the samples are folded
            onto it (``acc = acc + scale·P_s``) and the buffer is returned updated — micro-batches
            folded this way in sample order give the same bytes as one call over all samples.
        out_dtype: dtype of the returned gradient (default g's dtype; FP32 to keep the fold).
    Returns:
        (N, K) gradient.
    """
    m, n = g.shape
    k = x.shape[1]
    if x.shape[0] != m or sum(seqlens) != m or g.dtype != x.dtype or not (g.is_contiguous() and x.is_contiguous()):
        raise ValueError(f"gemm_dw expects contiguous g (M, N), x (M, K) of one dtype with sum(seqlens) == M; "
                         f"got g {tuple(g.shape)} {g.dtype}, x {tuple(x.shape)} {x.dtype}, sum(seqlens) {sum(seqlens)}")
    cfg = _configs.dw_config(n, k, g.dtype)
    bn = min(cfg["BLOCK_N"], _pow2_at_least(n))
    bk = min(cfg["BLOCK_K"], _pow2_at_least(k))
    if accumulate_into is not None:
        if accumulate_into.shape != (n, k) or accumulate_into.dtype != torch.float32 or not accumulate_into.is_contiguous():
            raise ValueError(f"accumulate_into must be a contiguous fp32 ({n}, {k}) buffer")
        out = accumulate_into
    else:
        out = torch.empty((n, k), dtype=out_dtype or g.dtype, device=g.device)
    starts = _starts(tuple(seqlens), g.device)
    grid = (triton.cdiv(n, bn) * triton.cdiv(k, bk),)
    _gemm_dw_kernel[grid](
        g, x, starts, out if accumulate_into is not None else g, out,
        n, k, len(seqlens), g.stride(0), x.stride(0), float(scale),
        PROLOGUE=PROLOGUES[prologue], HAS_INIT=accumulate_into is not None, DOT_PRECISION=_DOT_PRECISION,
        BLOCK_N=bn, BLOCK_K=bk, BLOCK_M=cfg["BLOCK_M"], GROUP_N=cfg["GROUP_N"], **_launch_opts(cfg),
    )
    return out


def gemm_db(g: torch.Tensor, seqlens: tuple[int, ...], *, accumulate_into: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-sample bias gradient ``Σ_s Σ_rows g``, folded in sample order. g: (M, N) → (N,)."""
    m, n = g.shape
    if sum(seqlens) != m or not g.is_contiguous():
        raise ValueError(f"gemm_db expects a contiguous g (M, N) with sum(seqlens) == M; got {tuple(g.shape)}, {sum(seqlens)}")
    if accumulate_into is not None:
        if accumulate_into.shape != (n,) or accumulate_into.dtype != torch.float32:
            raise ValueError(f"accumulate_into must be an fp32 ({n},) buffer")
        out = accumulate_into
    else:
        out = torch.empty((n,), dtype=out_dtype or g.dtype, device=g.device)
    starts = _starts(tuple(seqlens), g.device)
    opts = {} if _interpreting() else {"num_warps": 4, "num_stages": 2, "enable_fp_fusion": False}
    _gemm_db_kernel[(triton.cdiv(n, _DB_BLOCK_N),)](
        g, starts, out if accumulate_into is not None else g, out, n, len(seqlens), g.stride(0),
        HAS_INIT=accumulate_into is not None, BLOCK_N=_DB_BLOCK_N, BLOCK_M=_DB_BLOCK_M, **opts,
    )
    return out


def act_bwd(dy: torch.Tensor, z: torch.Tensor, epilogue: str) -> torch.Tensor:
    """dZ = dY · epilogue'(Z), elementwise; dy, z: (M, N) execution dtype."""
    dz = torch.empty_like(dy)
    n = dy.numel()
    if n:
        opts = {} if _interpreting() else {"num_warps": 4, "enable_fp_fusion": False}
        _act_bwd_kernel[(triton.cdiv(n, _ACT_BLOCK),)](dy, z, dz, n, ACT=EPILOGUES[epilogue], BLOCK=_ACT_BLOCK, **opts)
    return dz


def act_fwd(x: torch.Tensor, act: str) -> torch.Tensor:
    """h = act(x) elementwise (FP32 math, one cast): the prologue pass. x: contiguous."""
    h = torch.empty_like(x)
    n = x.numel()
    if n:
        opts = {} if _interpreting() else {"num_warps": 4, "enable_fp_fusion": False}
        _act_fwd_kernel[(triton.cdiv(n, _ACT_BLOCK),)](x, h, n, ACT=EPILOGUES[act], BLOCK=_ACT_BLOCK, **opts)
    return h


def gemm_fwd(x, weight, bias=None, *, prologue="none", epilogue="none", lora=None, store_pre=False,
             return_h=False):
    """Forward product. x: (M, K), weight: (N, K), bias: (N,) — fp32 or bf16, contiguous.

    Returns ``(y (M, N), pre (M, N) or None, u (M, r) or None)``: the output, the pre-activation
    (stored only when ``store_pre`` and an epilogue is set) and the LoRA intermediate ``p(x) Aᵀ``;
    with ``return_h`` a fourth item, ``p(x)`` when the prologue ran as its own pass (else None).

    The SiLU prologue runs as its own elementwise pass (``configs`` key ``"prologue"``: ``"pass"``,
    the default) or fused into the main loop (``"fused"``); both round ``silu(x)`` once to the
    execution dtype before the tensor cores, so they give the same bytes — the pass evaluates each
    element once instead of once per ``BLOCK_N`` column tile.
    """
    m, k = x.shape
    n = weight.shape[0]
    pro = PROLOGUES[prologue]
    cfg = _configs.fwd_config(n, k, x.dtype)
    h = None
    if pro and cfg.get("prologue", "pass") == "pass":
        h = act_fwd(x, prologue)
        x, pro = h, 0
    if cfg["weight_layout"] == "kn":
        b, b_strides = prepacked_weight(weight), (n, 1)
    else:
        b, b_strides = weight, (1, k)
    u = None
    lora_kw = {}
    if lora is not None:
        la, lb, scale = lora
        r = la.shape[0]
        u, _ = _main(x, la, (1, k), r, prologue=pro)  # u = p(x) Aᵀ, A (r, K) read as (K, r)
        lora_kw = dict(lora_u=u, lora_l=lb, lora_l_strides=(1, r), lora_scale=scale)  # B (N, r) as (r, N)
    store = store_pre and epilogue != "none"
    y, pre = _main(x, b, b_strides, n, prologue=pro, epilogue=EPILOGUES[epilogue], bias=bias,
                   store_pre=store, **lora_kw)
    return (y, pre, u, h) if return_h else (y, pre, u)


def gemm_bwd(dy, x, weight, *, seqlens, prologue="none", epilogue="none", pre=None, lora=None, u=None,
             needs=(True, True, True, True, True), h=None):
    """Backward of :func:`gemm_fwd`. dy: (M, N). Returns (dx, dW, db, dA, dB); None where not needed.

    ``h``: ``p(x)`` from the forward's prologue pass, if it ran; dW/dA then read it instead of
    recomputing the prologue per tile (same bytes: the same rounded values enter the same dots)."""
    need_x, need_w, need_b, need_a, need_lb = needs
    m, k = x.shape
    dz = act_bwd(dy, pre, epilogue) if epilogue != "none" else dy
    dx = dw = db = da = dlb = None
    v = None
    if lora is not None and (need_x or need_a):
        la, lb, scale = lora
        r = la.shape[0]
        v, _ = _main(dz, lb, (r, 1), r)  # v = dZ B (M, r)
    if need_x:
        kw = {}
        if lora is not None:
            kw = dict(lora_u=v, lora_l=lora[0], lora_l_strides=(k, 1), lora_scale=lora[2])  # + s·v A
        if prologue == "silu":
            kw.update(epilogue=3, aux=x)
        dx, _ = _main(dz, weight, (k, 1), k, **kw)  # dX = dZ W (+ s·v A) [· silu'(x)]
    xw, pw = (h, "none") if h is not None else (x, prologue)
    if need_w:
        dw = gemm_dw(dz, xw, seqlens, prologue=pw)
    if need_b:
        db = gemm_db(dz, seqlens)
    if lora is not None:
        if need_a:
            da = gemm_dw(v, xw, seqlens, prologue=pw, scale=lora[2])
        if need_lb:
            dlb = gemm_dw(dz, u, seqlens, scale=lora[2])
    return dx, dw, db, da, dlb


class GemmFunction(torch.autograd.Function):
    """Autograd wrapper: gradients for x, weight, bias and LoRA A/B, each when required."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, seqlens, prologue, epilogue, lora_scale):
        lora = (lora_a, lora_b, lora_scale) if lora_a is not None else None
        y, pre, u, h = gemm_fwd(x, weight, bias, prologue=prologue, epilogue=epilogue, lora=lora, store_pre=True,
                                return_h=True)
        ctx.save_for_backward(x, weight, pre, u, lora_a, lora_b, h)
        ctx.meta = (seqlens, prologue, epilogue, lora_scale)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, pre, u, lora_a, lora_b, h = ctx.saved_tensors
        seqlens, prologue, epilogue, lora_scale = ctx.meta
        lora = (lora_a, lora_b, lora_scale) if lora_a is not None else None
        ni = ctx.needs_input_grad
        dx, dw, db, da, dlb = gemm_bwd(
            dy.contiguous(), x, weight, seqlens=seqlens, prologue=prologue, epilogue=epilogue, pre=pre,
            lora=lora, u=u, needs=(ni[0], ni[1], ni[2], ni[3], ni[4]), h=h)
        return dx, dw, db, da, dlb, None, None, None, None


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         seqlens: tuple[int, ...], prologue: str = "none", epilogue: str = "none", lora=None) -> torch.Tensor:
    """GEMM-family operator (docs/operators.md): ``epilogue(p(x) Wᵀ + b + scale·(p(x) Aᵀ) Bᵀ)``.

    x: (M, K) fp32|bf16 contiguous on CUDA; weight: (N, K); bias: (N,) or None; seqlens: rows per
    sample (used by the backward reductions); lora: None or (A (r, K), B (N, r), scale).
    Returns (M, N) in x's dtype. Differentiable in x, weight, bias, A and B.
    """
    check_inputs(x, weight, bias, seqlens, prologue, epilogue, lora)
    la, lb, scale = lora if lora is not None else (None, None, 1.0)
    tensors = [t for t in (x, weight, bias, la, lb) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return GemmFunction.apply(x, weight, bias, la, lb, seqlens, prologue, epilogue, float(scale))
    return gemm_fwd(x, weight, bias, prologue=prologue, epilogue=epilogue, lora=lora)[0]


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------

GEMM_OPS = ("latent_proj_gemm", "qkv_bias_gemm", "attn_out_bias_gemm", "mlp_up_gemm_gelu",
            "mlp_down_gemm", "adaln_mod_projection")

_REDUCTION_ORDER = (
    "fwd/dX: each (BLOCK_M, BLOCK_N) tile reduced by one program (persistent programs walk several tiles), "
    "K in BLOCK_K steps from 0 by tl.dot into one FP32 accumulator chain, "
    "tiles from (N, K, dtype) only, no split-K; dW/db: per sample over its "
    "own rows in BLOCK_M chunks from its first row, FP32 partials folded left in sample order"
)

import hashlib as _hashlib  # noqa: E402
import inspect as _inspect  # noqa: E402
import sys as _sys  # noqa: E402

_CONFIGS_SHA256 = _hashlib.sha256(_inspect.getsource(_configs).encode()).hexdigest()[:16]

for _op in GEMM_OPS:
    register(KernelImpl(
        op=_op, backend="triton", device="cuda", dtypes=frozenset(_DTYPES), fn=gemm, strict=True, split_k=False,
        kernel_name="_gemm_fwd_kernel/_gemm_dw_kernel/_gemm_db_kernel/_act_fwd_kernel/_act_bwd_kernel",
        source=_sys.modules[__name__],
        config={"table": "mmdit_strict.kernels.triton.configs", "keyed_by": "(N, K, dtype)",
                "configs_sha256": _CONFIGS_SHA256, "dot_precision": _DOT_PRECISION, "fp_fusion": False},
        reduction_order=_REDUCTION_ORDER, accumulator="fp32",
    ))

"""Backward kernels of the strict joint attention (Triton): Δ, dK/dV per key tile, dQ per query tile.

Contract and arithmetic: :mod:`.attention`. Deterministic, no atomics: one program per (key tile, head) owns
that tile's dK and dV over the sample's query tiles (text then image, ascending); one program per (query tile,
head) owns its dQ over the sample's key tiles in the forward's order. Every loop bound and mask comes from the
sample's own lengths in the tile table (:mod:`.attention_fwd_kernels` documents its columns). The streamed
tiles are read through pointers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention_fwd_kernels import _load_resident, _program_tile, _segment_ptrs

@triton.jit
def _bwd_delta_kernel(o_txt_ptr, o_img_ptr, do_txt_ptr, do_img_ptr, delta_ptr, tiles_ptr, row_stride, n_heads,
                      D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Δ = rowsum(dO ∘ O) in FP32 for one (query tile, head); the row sum is tl.sum over d."""
    h, _, _, stat0, _, _, _, _, _, offs_m, row_ok, offs, txt_ok, img_ok = _program_tile(tiles_ptr, row_stride, D, BLOCK_M)
    o = tl.where(txt_ok, tl.load(o_txt_ptr + offs, mask=txt_ok, other=0.0), tl.load(o_img_ptr + offs, mask=img_ok, other=0.0)).to(tl.float32)
    do = tl.where(txt_ok, tl.load(do_txt_ptr + offs, mask=txt_ok, other=0.0), tl.load(do_img_ptr + offs, mask=img_ok, other=0.0)).to(tl.float32)
    tl.store(delta_ptr + (stat0 + offs_m).to(tl.int64) * n_heads + h, tl.sum(o * do, 1), mask=row_ok)


@triton.jit
def _dkdv_tile(dk, dv, k, v, q, do, lse, delta, qk_scale, DOT_PRECISION: tl.constexpr):
    """One query tile's contribution to a key tile's dK (unscaled) and dV; masked rows carry lse = +inf."""
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BN, BM) = (Q Kᵀ)ᵀ
    p_t = tl.math.exp2(tl.fma(s_t, qk_scale, -lse[None, :]))
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_segment(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, row0, n, stat0, row_stride, col, n_heads,
                  qk_scale, D: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  STAT_BASE: tl.constexpr):
    """Query tiles of one segment, ascending from its first row, through pointer loads; the last tile peeled
    (masked: its missing rows read 0 and their LSE +inf, so they add nothing).

    ``STAT_BASE`` (:attr:`AttentionConfig.stat_base`): how the tile's LSE and Δ entries are addressed.
    False: a 64-bit offset vector advanced per query tile; True: scalar base pointers advanced per query
    tile plus one loop-invariant 32-bit offset vector (fewer registers and integer instructions in the
    loop). The same entries are read either way.
    """
    offs_m = tl.arange(0, BLOCK_M)
    if STAT_BASE:
        lse_ptr += stat0.to(tl.int64) * n_heads
        delta_ptr += stat0.to(tl.int64) * n_heads
        stat = offs_m * n_heads
        stat_step = (BLOCK_M * n_heads).to(tl.int64)
    else:
        stat = (stat0 + offs_m).to(tl.int64) * n_heads
    n_full = n // BLOCK_M
    tail = n - n_full * BLOCK_M
    q_ptrs, do_ptrs, step = _segment_ptrs(q_ptr, do_ptr, row0, row_stride, col, BLOCK_M, D)
    for _ in range(0, n_full):
        q = tl.load(q_ptrs)
        do = tl.load(do_ptrs)
        lse = tl.load(lse_ptr + stat)
        delta = tl.load(delta_ptr + stat)
        dk, dv = _dkdv_tile(dk, dv, k, v, q, do, lse, delta, qk_scale, DOT_PRECISION)
        q_ptrs += step
        do_ptrs += step
        if STAT_BASE:
            lse_ptr += stat_step
            delta_ptr += stat_step
        else:
            stat += BLOCK_M * n_heads
    if tail > 0:
        ok = offs_m < tail
        q = tl.load(q_ptrs, mask=ok[:, None], other=0.0)
        do = tl.load(do_ptrs, mask=ok[:, None], other=0.0)
        lse = tl.load(lse_ptr + stat, mask=ok, other=float("inf"))
        delta = tl.load(delta_ptr + stat, mask=ok, other=0.0)
        dk, dv = _dkdv_tile(dk, dv, k, v, q, do, lse, delta, qk_scale, DOT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_txt_ptr, k_txt_ptr, v_txt_ptr, q_img_ptr, k_img_ptr, v_img_ptr, do_txt_ptr, do_img_ptr,
    dk_txt_ptr, dv_txt_ptr, dk_img_ptr, dv_img_ptr, lse_ptr, delta_ptr, tiles_ptr,
    row_stride, n_heads, qk_scale, sm_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    RESIDENT_DIRECT: tl.constexpr, STAT_BASE: tl.constexpr,
):
    """One (key tile, head): dK and dV over the sample's query tiles (text, then image). Grid (key tiles, heads)."""
    h, col, stream, _, t_start, nt, i_start, ni, i_stat0, _, row_ok, offs, txt_ok, img_ok = _program_tile(
        tiles_ptr, row_stride, D, BLOCK_N)
    k = _load_resident(k_txt_ptr, k_img_ptr, offs, row_ok, stream, RESIDENT_DIRECT)
    v = _load_resident(v_txt_ptr, v_img_ptr, offs, row_ok, stream, RESIDENT_DIRECT)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    lse_ptr += h  # stat buffers are (rows, H): this head's column
    delta_ptr += h
    dk, dv = _dkdv_segment(dk, dv, k, v, q_txt_ptr, do_txt_ptr, lse_ptr, delta_ptr, t_start, nt, t_start,
                           row_stride, col, n_heads, qk_scale, D, BLOCK_M, DOT_PRECISION, STAT_BASE)
    dk, dv = _dkdv_segment(dk, dv, k, v, q_img_ptr, do_img_ptr, lse_ptr, delta_ptr, i_start, ni, i_stat0,
                           row_stride, col, n_heads, qk_scale, D, BLOCK_M, DOT_PRECISION, STAT_BASE)
    dk = (dk * sm_scale).to(dk_txt_ptr.dtype.element_ty)
    dv = dv.to(dv_txt_ptr.dtype.element_ty)
    tl.store(dk_txt_ptr + offs, dk, mask=txt_ok)
    tl.store(dv_txt_ptr + offs, dv, mask=txt_ok)
    tl.store(dk_img_ptr + offs, dk, mask=img_ok)
    tl.store(dv_img_ptr + offs, dv, mask=img_ok)


@triton.jit
def _dq_tile(dq, q, do, k, v, lse, delta, qk_scale, n_valid,
             BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile's contribution to a query tile's dQ (unscaled)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    p = tl.math.exp2(tl.fma(s, qk_scale, -lse[:, None]))
    if MASKED:
        p = tl.where(tl.arange(0, BLOCK_N)[None, :] < n_valid, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _dq_segment(dq, q, do, lse, delta, k_ptr, v_ptr, row0, n, row_stride, col, qk_scale,
                D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Key tiles of one segment, ascending from its first row, through pointer loads; the last tile peeled and
    masked (its missing columns get P = 0)."""
    n_full = n // BLOCK_N
    tail = n - n_full * BLOCK_N
    k_ptrs, v_ptrs, step = _segment_ptrs(k_ptr, v_ptr, row0, row_stride, col, BLOCK_N, D)
    for _ in range(0, n_full):
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
        dq = _dq_tile(dq, q, do, k, v, lse, delta, qk_scale, BLOCK_N, BLOCK_N, False, DOT_PRECISION)
        k_ptrs += step
        v_ptrs += step
    if tail > 0:
        ok = (tl.arange(0, BLOCK_N) < tail)[:, None]
        k = tl.load(k_ptrs, mask=ok, other=0.0)
        v = tl.load(v_ptrs, mask=ok, other=0.0)
        dq = _dq_tile(dq, q, do, k, v, lse, delta, qk_scale, tail, BLOCK_N, True, DOT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    q_txt_ptr, k_txt_ptr, v_txt_ptr, q_img_ptr, k_img_ptr, v_img_ptr, do_txt_ptr, do_img_ptr,
    dq_txt_ptr, dq_img_ptr, lse_ptr, delta_ptr, tiles_ptr,
    row_stride, n_heads, qk_scale, sm_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    RESIDENT_DIRECT: tl.constexpr,
):
    """One (query tile, head): dQ over the sample's key tiles in the forward's order. Grid (query tiles, heads)."""
    h, col, stream, stat0, t_start, nt, i_start, ni, _, offs_m, row_ok, offs, txt_ok, img_ok = _program_tile(
        tiles_ptr, row_stride, D, BLOCK_M)
    q = _load_resident(q_txt_ptr, q_img_ptr, offs, row_ok, stream, RESIDENT_DIRECT)
    do = _load_resident(do_txt_ptr, do_img_ptr, offs, row_ok, stream, RESIDENT_DIRECT)
    stat = (stat0 + offs_m).to(tl.int64) * n_heads + h
    lse = tl.load(lse_ptr + stat, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + stat, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    dq = _dq_segment(dq, q, do, lse, delta, k_txt_ptr, v_txt_ptr, t_start, nt, row_stride, col, qk_scale,
                     D, BLOCK_N, DOT_PRECISION)
    dq = _dq_segment(dq, q, do, lse, delta, k_img_ptr, v_img_ptr, i_start, ni, row_stride, col, qk_scale,
                     D, BLOCK_N, DOT_PRECISION)
    dq = (dq * sm_scale).to(dq_txt_ptr.dtype.element_ty)
    tl.store(dq_txt_ptr + offs, dq, mask=txt_ok)
    tl.store(dq_img_ptr + offs, dq, mask=img_ok)

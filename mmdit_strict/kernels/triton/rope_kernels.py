"""Kernels of the strict QK preprocessing (Triton): per-head RMSNorm, multi-axis RoPE, both fused.

Contract, arithmetic and cast points: :mod:`.rope` (the host side: launch configuration table, launchers,
autograd, registry). One forward kernel (:func:`_qk_fwd_kernel`) and one backward kernel
(:func:`_qk_bwd_chunk_kernel`) serve every operator of the family; the arithmetic lives in the ``@triton.jit``
helpers they share.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _head_tile(H, W, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr):
    """A token's (BLOCK_H, BLOCK_W) tile of H heads × W lanes: (offs_h, offs_w, mask_h, mask_w, mask)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_w = tl.arange(0, BLOCK_W)
    mask_h = offs_h < H
    mask_w = offs_w < W
    return offs_h, offs_w, mask_h, mask_w, mask_h[:, None] & mask_w[None, :]



# A token's heads are one contiguous (BLOCK_H, BLOCK_D) tile, loaded and stored whole (16-byte vector
# accesses); the rotation pairs are formed in registers (reshape to (.., d/2, 2) + split, then join).
# One forward kernel serves qk_rmsnorm, multi_axis_rope (and its backward) and the fused op, and one
# backward kernel serves qk_rmsnorm's and the fused op's backward: what differs between them are RUNTIME
# flags (``do_not_specialize``: an int flag of value 1 would otherwise become a compile-time constant),
# so the unfused and the fused call run one compiled binary, hence one layout and one summation tree for
# every tl.sum. The arithmetic lives in the @triton.jit helpers below, used by both kernels.


@triton.jit
def _rms_rstd(x, d_float, eps):
    """x (BH, BD) FP32 (zeros past d) → rstd (BH,) = 1 ⊘ √(tl.sum(x·x over the d lanes) ⊘ d + eps)."""
    return tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(x * x, axis=1), d_float) + eps))


@triton.jit
def _pair_tables(cos_ptr, sin_ptr, row, stride_cs, P, sign, BLOCK_D: tl.constexpr):
    """The token's (c, s·sign) as (1, BD/2) FP32 rows (0 past P = d/2); sign −1.0 rotates by −θ (exact)."""
    offs_p = tl.arange(0, BLOCK_D // 2)
    mask_p = offs_p < P
    c = tl.load(cos_ptr + row * stride_cs + offs_p, mask=mask_p, other=0.0)
    s = tl.load(sin_ptr + row * stride_cs + offs_p, mask=mask_p, other=0.0) * sign
    return c[None, :], s[None, :]


@triton.jit
def _rotate_pairs(t, c, s, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Interleaved pairs (t[2i], t[2i+1]) of the (BH, BD) FP32 tile → (t_e·c − t_o·s, t_e·s + t_o·c)."""
    e, o = tl.split(tl.reshape(t, (BLOCK_H, BLOCK_D // 2, 2)))
    r_e = e * c - o * s
    r_o = e * s + o * c
    return tl.reshape(tl.join(r_e, r_o), (BLOCK_H, BLOCK_D))


@triton.jit
def _rms_bwd(x, dy, rstd, g, d_float):
    """x, dy (BH, BD) FP32, rstd (BH,), g (1, BD) → (dx, dy·x̂): x̂ = x·rstd, gl = dy·g,
    dx = (gl − x̂·(tl.sum(gl·x̂ over d) ⊘ d))·rstd."""
    xh = x * rstd[:, None]
    gl = dy * g
    c1 = tl.div_rn(tl.sum(gl * xh, axis=1), d_float)[:, None]
    return (gl - xh * c1) * rstd[:, None], dy * xh


@triton.jit
def _qk_fwd_heads(x_ptr, cos_ptr, sin_ptr, y_ptr, rstd_ptr, row, h0, H, D, d_float, eps, sign, stride_x, stride_y,
                  stride_cs, g, offs_j, mask_j, norm, rope, store_rstd, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Heads h0 .. h0 + BLOCK_H of token ``row`` (those < H) as one (BLOCK_H, BLOCK_D) tile: the forward of
    :func:`_qk_fwd_kernel`, loaded, normalized and/or rotated, stored."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    mask = mask_h[:, None] & mask_j[None, :]
    offs = offs_h[:, None] * D + offs_j[None, :]
    y = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if norm:
        rstd = _rms_rstd(y, d_float, eps)
        y = (y * rstd[:, None]) * g
        if store_rstd:
            tl.store(rstd_ptr + row * H + offs_h, rstd, mask=mask_h)
        if rope:
            y = y.to(y_ptr.dtype.element_ty).to(tl.float32)  # the unfused pair's cast point
    if rope:
        c, s = _pair_tables(cos_ptr, sin_ptr, row, stride_cs, D // 2, sign, BLOCK_D)
        y = _rotate_pairs(y, c, s, BLOCK_H, BLOCK_D)
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows", "norm", "rope", "store_rstd"])
def _qk_fwd_kernel(
    x_ptr, gain_ptr, cos_ptr, sin_ptr, y_ptr, rstd_ptr,
    n_rows, H, D, d_float, eps, sign, stride_x, stride_y, stride_cs,
    norm, rope, store_rstd,
    TOKENS: tl.constexpr, STAGES: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_H2: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """TOKENS consecutive tokens (the last program: what is left). A token's heads are one (BLOCK_H, d) tile, or
    with BLOCK_H2 > 0 two: heads [0, BLOCK_H) and [BLOCK_H, BLOCK_H + BLOCK_H2) (24 heads as 16 + 8 instead of a
    32-head tile with 8 masked). norm: rstd per head, y = (x·rstd)·gain (with rope: y rounded to the storage
    dtype, the unfused pair's cast point); rope: pairs rotated by θ (sign 1.0) or −θ (sign −1.0); store_rstd:
    rstd (FP32) saved. One cast at the store. STAGES (None or 2..8): the token loop pipelined through shared
    memory. The arithmetic is per (token, head): a head's Σ x² runs along its d lanes, which every tile holds
    the same way when the host gives the split its warps (:func:`_contig_fwd`)."""
    first = tl.program_id(0).to(tl.int64) * TOKENS
    offs_j = tl.arange(0, BLOCK_D)
    mask_j = offs_j < D
    g = tl.load(gain_ptr + offs_j, mask=offs_j < D * norm, other=0.0).to(tl.float32)[None, :]  # norm is 0 or 1
    for t in tl.range(0, tl.minimum(n_rows - first, TOKENS), num_stages=STAGES):
        row = first + t
        _qk_fwd_heads(x_ptr, cos_ptr, sin_ptr, y_ptr, rstd_ptr, row, 0, H, D, d_float, eps, sign, stride_x, stride_y,
                      stride_cs, g, offs_j, mask_j, norm, rope, store_rstd, BLOCK_H, BLOCK_D)
        if BLOCK_H2 > 0:
            _qk_fwd_heads(x_ptr, cos_ptr, sin_ptr, y_ptr, rstd_ptr, row, BLOCK_H, H, D, d_float, eps, sign, stride_x,
                          stride_y, stride_cs, g, offs_j, mask_j, norm, rope, store_rstd, BLOCK_H2, BLOCK_D)


@triton.jit
def _bwd_token(x_ptr, dy_ptr, rstd_ptr, cos_ptr, sin_ptr, row, live, rope, H, D, stride_x, stride_dy, stride_cs,
               offs, offs_h, mask_j, BLOCK_D: tl.constexpr):
    """What :func:`_qk_bwd_chunk_kernel` reads for token ``row``: the x and dy tiles (storage dtype), rstd
    (BH,) and the −θ tables (c, −s) as (1, BD/2) FP32; nothing is read (zeros) when not ``live``, and no
    tables without ``rope``."""
    h_live = tl.where(live, H, 0)
    m = (offs_h < h_live)[:, None] & mask_j[None, :]
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0)
    d = tl.load(dy_ptr + row * stride_dy + offs, mask=m, other=0.0)
    r = tl.load(rstd_ptr + row * H + offs_h, mask=offs_h < h_live, other=0.0)
    c, s = _pair_tables(cos_ptr, sin_ptr, row, stride_cs, tl.where(live & (rope != 0), D // 2, 0), -1.0, BLOCK_D)
    return x, d, r, c, s


@triton.jit(do_not_specialize=["n_chunks", "rope", "need_gain"])
def _qk_bwd_chunk_kernel(
    x_ptr, gain_ptr, cos_ptr, sin_ptr, dy_ptr, rstd_ptr, table_ptr, dx_ptr, part_ptr,
    n_chunks, H, D, d_float, stride_x, stride_dy, stride_dx, stride_cs, stride_part,
    rope, need_gain,
    AHEAD: tl.constexpr, STAGES: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The backward: one chunk of tokens of one sample,
    tokens in order, everything a token needs (x, dy, rstd, tables) read AHEAD (1..3) tokens ahead into
    registers, or (AHEAD 0) where used, with STAGES (2..8) the loop pipelined through shared memory. rope: dy
    rotated by −θ and rounded to the storage dtype (the unfused pair's cast point); dx = (g − x̂·(Σ g·x̂ ⊘ d))·rstd
    per (token, head); need_gain: per (head, lane) acc = 0, acc = acc + dy·x̂ over the chunk's tokens in
    order, then part[c] = tl.sum of acc over heads (one cross-warp reduction per chunk, none per token).
    AHEAD changes when a token is read, not what is computed."""
    c = tl.program_id(0)
    start = tl.load(table_ptr + c)
    n = tl.load(table_ptr + n_chunks + c) - start
    offs_h, offs_j, _, mask_j, mask = _head_tile(H, D, BLOCK_H, BLOCK_D)
    offs = offs_h[:, None] * D + offs_j[None, :]
    g = tl.load(gain_ptr + offs_j, mask=mask_j, other=0.0).to(tl.float32)[None, :]
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    first = start.to(tl.int64)
    if AHEAD >= 1:
        x0, d0, r0, c0, s0 = _bwd_token(x_ptr, dy_ptr, rstd_ptr, cos_ptr, sin_ptr, first, n > 0, rope, H, D,
                                        stride_x, stride_dy, stride_cs, offs, offs_h, mask_j, BLOCK_D)
    if AHEAD >= 2:
        x1, d1, r1, c1, s1 = _bwd_token(x_ptr, dy_ptr, rstd_ptr, cos_ptr, sin_ptr, first + 1, n > 1, rope, H, D,
                                        stride_x, stride_dy, stride_cs, offs, offs_h, mask_j, BLOCK_D)
    if AHEAD >= 3:
        x2, d2, r2, c2, s2 = _bwd_token(x_ptr, dy_ptr, rstd_ptr, cos_ptr, sin_ptr, first + 2, n > 2, rope, H, D,
                                        stride_x, stride_dy, stride_cs, offs, offs_h, mask_j, BLOCK_D)
    for i in tl.range(0, n, num_stages=STAGES):
        row = first + i
        if AHEAD == 0:  # read where used: with STAGES, the pipeliner reads ahead through shared memory
            x0, d0, r0, c0, s0 = _bwd_token(x_ptr, dy_ptr, rstd_ptr, cos_ptr, sin_ptr, row, i < n, rope, H, D,
                                            stride_x, stride_dy, stride_cs, offs, offs_h, mask_j, BLOCK_D)
        else:
            xn, dn, rn, cn, sn = _bwd_token(x_ptr, dy_ptr, rstd_ptr, cos_ptr, sin_ptr, row + AHEAD, i + AHEAD < n, rope,
                                            H, D, stride_x, stride_dy, stride_cs, offs, offs_h, mask_j, BLOCK_D)
        dy = d0.to(tl.float32)
        if rope:
            dy = _rotate_pairs(dy, c0, s0, BLOCK_H, BLOCK_D)
            dy = dy.to(dx_ptr.dtype.element_ty).to(tl.float32)  # the unfused pair's cast point
        dx, term = _rms_bwd(x0.to(tl.float32), dy, r0, g, d_float)
        tl.store(dx_ptr + row * stride_dx + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if need_gain:
            acc = acc + term
        if AHEAD == 1:
            x0, d0, r0, c0, s0 = xn, dn, rn, cn, sn
        elif AHEAD == 2:
            x0, d0, r0, c0, s0 = x1, d1, r1, c1, s1
            x1, d1, r1, c1, s1 = xn, dn, rn, cn, sn
        elif AHEAD == 3:
            x0, d0, r0, c0, s0 = x1, d1, r1, c1, s1
            x1, d1, r1, c1, s1 = x2, d2, r2, c2, s2
            x2, d2, r2, c2, s2 = xn, dn, rn, cn, sn
    if need_gain:
        tl.store(part_ptr + c.to(tl.int64) * stride_part + offs_j, tl.sum(acc, axis=0), mask=mask_j)

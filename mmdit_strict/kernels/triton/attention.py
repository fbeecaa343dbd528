"""CUDA strict joint attention (Triton): packed, padding-invariant, deterministic flash attention.

``joint_attention_fused(q_txt, k_txt, v_txt, q_img, k_img, v_img, *, txt_seqlens, img_seqlens)``:
text rows ``(Mt, H, d)`` and image rows ``(Mi, H, d)``, packed sample after sample in each stream.
Sample ``s`` attends (non-causal) over its own keys ``[text_s; image_s]``; the result comes back as
``(o_txt (Mt, H·d), o_img (Mi, H·d))`` in the input dtype. The kernels read both streams in place:
nothing is concatenated or padded.

Geometry (docs/operators.md, "joint_attention_fused"):

* A sample's rows form two **segments**, its text rows and its image rows, each anchored at that
  segment's own first row in its stream's buffer. Query tiles and key/value tiles are cut from each
  segment separately, starting at the segment's first row (never at a multiple of the tile in the
  packed buffer). The tile list is host data cached per ``(seqlens, tile, device)`` in a device
  table; the kernels read every length and offset from that table, so no batch-derived integer is a
  kernel argument (Triton specializes integer arguments on ``== 1`` and ``% 16``) and no host→device
  copy happens on a repeated call with the same seqlens.
* Every query tile walks the sample's key tiles in one fixed order: text tiles ascending, then image
  tiles ascending (the joint ``[text, image]`` order). The last tile of a segment is peeled: it is
  loaded with a boundary check at the segment's end (the rows of the next sample are never read) and
  its missing columns get score ``−inf``. No split-KV, no atomics.
* Configurations (tiles, warps, stages) are frozen per ``(head_dim, dtype)`` in :data:`CONFIGS`.

Forward arithmetic per query row (FP32 throughout, base 2): ``c = fp32(log2(e)/√d)``;
for each key tile ``S = Q Kᵀ`` (one ``tl.dot``, FP32 accumulate; IEEE FP32 products for FP32
inputs, never TF32); ``m' = max(m, rowmax(S)·c)``; ``P = exp2(fma(S, c, −m'))`` (the scale and the
max subtraction in one FP32 FMA); ``α = exp2(m − m')``; ``l = l·α + rowsum(P)``;
``acc = acc·α + P̃ V`` with ``P̃`` = P rounded to the input dtype. At the end
``O = acc / l`` (IEEE division, one rounding), cast once to the input dtype, and the base-2
log-sum-exp ``lse = m + log2(l)`` is saved in FP32. ``exp2``/``log2`` are the GPU's ``ex2``/``lg2``
instructions (deterministic, a few ulp); every other step is one IEEE FP32 operation (kernels are
compiled with ``enable_fp_fusion=False``, so only the written ``fma`` fuses).

Backward (deterministic, no atomics): ``Δ = rowsum(dO ∘ O)`` in FP32 from the stored O;
``P = exp2(fma(S, c, −lse))`` recomputed in FP32; ``dP = dO Vᵀ``; ``dS = P ∘ (dP − Δ)``.
One program per key tile owns ``dK = s·Σ dSᵀ Q`` and ``dV = Σ P̃ᵀ dO`` over the sample's query
tiles (text then image, ascending); one program per query tile owns ``dQ = s·Σ dS̃ K`` over the
sample's key tiles in the forward's order (``s = fp32(1/√d)``; ``dS̃`` rounded to the input dtype
before its product). Each gradient is cast once to the input dtype.

Why a sample's bytes cannot depend on its batch: every tile, every loop bound and every mask is a
function of that sample's own text and image lengths; the configuration depends only on
``(head_dim, dtype)``; no program reads or writes another sample's rows.
"""

from __future__ import annotations

import math
import sys
import threading
from typing import Sequence

import torch
import triton
import triton.language as tl

from ..checks import check_operand
from ..keepalive import retain
from ..registry import KernelImpl, register
from . import attention_ws
from .gemm import _DTYPES, _interpreting, launch_opts

# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
# Tile table: one int32 row of _TABLE_COLS per tile (see _tile_table):
#   0 stream (0 text, 1 image)   1 first row of the tile in its stream buffer
#   2 end row (exclusive) of the tile's segment in that buffer   3 first row of the tile in the stat buffers
#   4 sample's first text row    5 its text rows   6 its first image row   7 its image rows
#   8 the sample's first image row in the stat buffers (Mt + column 6)
# Stat buffers (lse, Δ) are (Mt + Mi, H) FP32: text rows first, then image rows.


@triton.jit
def _tile_entry(tiles_ptr, tile):
    """The nine int32 columns of tile ``tile``'s table row (meanings above): stream, first row, segment end,
    first LSE row, text start, text rows, image start, image rows, first image LSE row."""
    t = tiles_ptr + tile * 9
    return (tl.load(t), tl.load(t + 1), tl.load(t + 2), tl.load(t + 3), tl.load(t + 4), tl.load(t + 5),
            tl.load(t + 6), tl.load(t + 7), tl.load(t + 8))


@triton.jit
def _stream_masks(row_ok, stream):
    """(rows, 1) store/load masks of a tile's valid rows in the text and in the image buffer."""
    stream_v = tl.zeros_like(row_ok.to(tl.int32)) + stream  # a vector: the interpreter rejects scalar & vector masks
    return (row_ok & (stream_v == 0))[:, None], (row_ok & (stream_v == 1))[:, None]


@triton.jit
def _program_tile(tiles_ptr, row_stride, D: tl.constexpr, ROWS: tl.constexpr):
    """Where this program works (grid (tiles, heads)): its head ``h`` and the head's first column ``col``, its tile's
    table entry less the first row and segment end (stream, first stat row, text start and rows, image start and
    rows, first image stat row), the row index vector ``0 .. ROWS``, the valid-row mask, the ``(ROWS, D)`` element
    offsets of the tile's rows in its stream buffer (64-bit rows) and the text/image store masks."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    stream, row0, seg_end, stat0, t_start, nt, i_start, ni, i_stat0 = _tile_entry(tiles_ptr, tile)
    col = h * D
    offs_m = tl.arange(0, ROWS)
    rows = row0 + offs_m
    row_ok = rows < seg_end
    offs = rows.to(tl.int64)[:, None] * row_stride + col + tl.arange(0, D)[None, :]
    txt_ok, img_ok = _stream_masks(row_ok, stream)
    return h, col, stream, stat0, t_start, nt, i_start, ni, i_stat0, offs_m, row_ok, offs, txt_ok, img_ok


@triton.jit
def _load_resident(txt_ptr, img_ptr, offs, row_ok, stream, DIRECT: tl.constexpr):
    """A tile's resident rows (loaded once per program) from the stream the tile lies in; rows past the segment read 0.

    ``DIRECT`` (config ``resident_loads``, see ``_RESIDENT``): False, two masked loads (one per stream) merged with
    ``tl.where``; True, one masked load through the stream's base pointer, chosen per program. Both give the same
    values. Only the direct load lets Triton keep the tile in shared memory in the layout the tensor cores read
    (Hopper: the wgmma A operand straight from shared memory); the merged one is held in registers.
    """
    if DIRECT:
        return tl.load(tl.where(stream == 0, txt_ptr, img_ptr) + offs, mask=row_ok[:, None], other=0.0)
    else:
        txt_ok, img_ok = _stream_masks(row_ok, stream)
        return tl.where(txt_ok, tl.load(txt_ptr + offs, mask=txt_ok, other=0.0), tl.load(img_ptr + offs, mask=img_ok, other=0.0))


@triton.jit
def _segment_desc(base_ptr, row0, n, row_stride, col, ROWS: tl.constexpr, D: tl.constexpr):
    """Tensor descriptor (TMA) over exactly one segment: rows ``row0 .. row0+n`` of one head's ``D`` columns.

    Box coordinates are relative to the segment's first row. Rows of a box past the segment's end lie outside
    the descriptor, so the TMA unit fills them with zeros instead of reading them; rows before the segment
    cannot be addressed at all. No box can carry another sample's rows, whatever the lengths. (The extent is
    at least 1 row so that an empty segment still makes a valid descriptor; nothing is loaded through it.)
    """
    return tl.make_tensor_descriptor(base_ptr + row0.to(tl.int64) * row_stride + col, shape=[tl.maximum(n, 1), D],
                                     strides=[row_stride, 1], block_shape=[ROWS, D])


@triton.jit
def _fwd_stats(m_i, l_i, s, qk_scale, n_valid, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """The online-softmax statistics of one key tile's scores ``s`` (module docstring): the FP32 probabilities
    ``p``, the rescale ``α`` of the accumulator, and the new row max and sum."""
    if MASKED:
        s = tl.where(tl.arange(0, BLOCK_N)[None, :] < n_valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(tl.fma(s, qk_scale, -m_new[:, None]))
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _fwd_tile(acc, m_i, l_i, q, k, v, qk_scale, n_valid,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile of the online softmax (see the module docstring for the formulas)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BM, BN) FP32
    p, alpha, m_i, l_i = _fwd_stats(m_i, l_i, s, qk_scale, n_valid, BLOCK_N, MASKED)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _segment_descs(a_ptr, b_ptr, row0, n, row_stride, col, ROWS: tl.constexpr, D: tl.constexpr):
    """The two streamed operands' TMA descriptors over one segment (:func:`_segment_desc`), e.g. K and V."""
    return (_segment_desc(a_ptr, row0, n, row_stride, col, ROWS, D),
            _segment_desc(b_ptr, row0, n, row_stride, col, ROWS, D))


@triton.jit
def _load_pair(a_desc, b_desc, row):
    """One box of each descriptor at segment row ``row`` (rows past the segment arrive as zeros)."""
    return a_desc.load([row, 0]), b_desc.load([row, 0])


@triton.jit
def _segment_ptrs(a_ptr, b_ptr, row0, row_stride, col, ROWS: tl.constexpr, D: tl.constexpr):
    """Pointer tiles of the two streamed operands at a segment's first row, and the 64-bit step of one tile."""
    return (_row_ptrs(a_ptr, row0, row_stride, col, ROWS, D), _row_ptrs(b_ptr, row0, row_stride, col, ROWS, D),
            ROWS * row_stride.to(tl.int64))


@triton.jit
def _fwd_segment_ahead(acc, m_i, l_i, q, k_ptr, v_ptr, row0, n, row_stride, col, qk_scale,
                       D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``_fwd_segment`` with TMA loads and ``P̃ V`` left running under the next tile's softmax (config
    ``fwd_overlap = "pv_async"``).

    Same tiles, same order and the same operations per tile as ``_fwd_segment`` (so the same bytes); only the
    issue order differs. Iteration ``j`` of the full-tile loop computes ``S_{j+1} = Q K_{j+1}ᵀ`` (waited on,
    which also completes the previous ``P̃ V``), rescales ``acc`` by ``αⱼ``, issues ``acc += P̃ⱼ Vⱼ`` and computes
    the statistics of ``S_{j+1}`` while the tensor cores run it (Triton leaves a dot asynchronous when its
    result is next read after a completed wait). Tile 0's scores are computed before the loop, the last full
    tile's ``P̃ V`` after it; the tail is peeled as in ``_fwd_segment``.

    Tile 0 sits in an ``if`` of its own (a condition that always holds there): Triton keeps the shared
    buffers of every dot that a loop's results depend on, in the loop's block, alive until the wait after
    the loop, and tile 0's K buffer then overlapped the loop's three K/V stages (263,168 B of shared
    memory at 3 stages, over the H200's 232,448: 5656ade). In its own block it is not traced; 230,400 B,
    as the frozen forward (``python -m benchmarks.attention_sass`` reports it).
    """
    n_full = n // BLOCK_N
    tail = n - n_full * BLOCK_N
    k_desc, v_desc = _segment_descs(k_ptr, v_ptr, row0, n, row_stride, col, BLOCK_N, D)
    row = 0
    if n_full > 0:
        p = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        alpha = tl.zeros([BLOCK_M], tl.float32)
        if n > 0:  # always true here: keeps tile 0's dot in a block of its own (see the docstring)
            s = tl.dot(q, tl.trans(k_desc.load([0, 0])), input_precision=DOT_PRECISION)
            p, alpha, m_i, l_i = _fwd_stats(m_i, l_i, s, qk_scale, BLOCK_N, BLOCK_N, False)
        for _ in range(1, n_full):
            s = tl.dot(q, tl.trans(k_desc.load([row + BLOCK_N, 0])), input_precision=DOT_PRECISION)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(q.dtype), v_desc.load([row, 0]), acc, input_precision=DOT_PRECISION)
            p, alpha, m_i, l_i = _fwd_stats(m_i, l_i, s, qk_scale, BLOCK_N, BLOCK_N, False)
            row += BLOCK_N
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(q.dtype), v_desc.load([row, 0]), acc, input_precision=DOT_PRECISION)
        row += BLOCK_N
    if tail > 0:
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_desc.load([row, 0]), v_desc.load([row, 0]), qk_scale, tail,
                                  BLOCK_N, True, DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _row_ptrs(base_ptr, row0, row_stride, col, ROWS: tl.constexpr, D: tl.constexpr):
    """(ROWS, D) pointers to rows row0.. of one head's columns ``col .. col+D`` (64-bit row offsets)."""
    rows = (row0 + tl.arange(0, ROWS)).to(tl.int64)
    return base_ptr + rows[:, None] * row_stride + col + tl.arange(0, D)[None, :]


@triton.jit
def _fwd_segment(acc, m_i, l_i, q, k_ptr, v_ptr, row0, n, row_stride, col, qk_scale,
                 D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, LOADS: tl.constexpr):
    """Key tiles of one segment (rows ``row0 .. row0+n`` of one stream), ascending; last tile peeled.

    ``LOADS`` (see ``_LOADS``): 0 pointer loads, masked on the last tile; 1 device-side tensor
    descriptors (TMA) spanning exactly the segment (:func:`_segment_desc`: the last tile's rows past the
    segment's end arrive as zeros); 2 block pointers bounded at the segment's end (Triton releases that
    still have them). All read the same values: the tail's missing rows are 0 in K and V on every path and
    their columns get score −inf, so the arithmetic and the result bytes are the same.
    """
    n_full = n // BLOCK_N
    tail = n - n_full * BLOCK_N
    if LOADS == 2:
        seg_end = row0 + n
        k_bp = tl.make_block_ptr(k_ptr + col, (seg_end, D), (row_stride, 1), (row0, 0), (BLOCK_N, D), (1, 0))
        v_bp = tl.make_block_ptr(v_ptr + col, (seg_end, D), (row_stride, 1), (row0, 0), (BLOCK_N, D), (1, 0))
        for _ in range(0, n_full):
            k = tl.load(k_bp)
            v = tl.load(v_bp)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, qk_scale, BLOCK_N, BLOCK_N, False, DOT_PRECISION)
            k_bp = tl.advance(k_bp, (BLOCK_N, 0))
            v_bp = tl.advance(v_bp, (BLOCK_N, 0))
        if tail > 0:
            k = tl.load(k_bp, boundary_check=(0,), padding_option="zero")
            v = tl.load(v_bp, boundary_check=(0,), padding_option="zero")
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, qk_scale, tail, BLOCK_N, True, DOT_PRECISION)
    elif LOADS == 1:
        k_desc, v_desc = _segment_descs(k_ptr, v_ptr, row0, n, row_stride, col, BLOCK_N, D)
        row = 0
        for _ in range(0, n_full):
            k, v = _load_pair(k_desc, v_desc, row)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, qk_scale, BLOCK_N, BLOCK_N, False, DOT_PRECISION)
            row += BLOCK_N
        if tail > 0:
            k, v = _load_pair(k_desc, v_desc, row)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, qk_scale, tail, BLOCK_N, True, DOT_PRECISION)
    else:
        k_ptrs, v_ptrs, step = _segment_ptrs(k_ptr, v_ptr, row0, row_stride, col, BLOCK_N, D)
        for _ in range(0, n_full):
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, qk_scale, BLOCK_N, BLOCK_N, False, DOT_PRECISION)
            k_ptrs += step
            v_ptrs += step
        if tail > 0:
            ok = (tl.arange(0, BLOCK_N) < tail)[:, None]
            k = tl.load(k_ptrs, mask=ok, other=0.0)
            v = tl.load(v_ptrs, mask=ok, other=0.0)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k, v, qk_scale, tail, BLOCK_N, True, DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _attn_fwd_kernel(
    q_txt_ptr, k_txt_ptr, v_txt_ptr, q_img_ptr, k_img_ptr, v_img_ptr, o_txt_ptr, o_img_ptr, lse_ptr, tiles_ptr,
    row_stride, n_heads, qk_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, LOADS: tl.constexpr,
    RESIDENT_DIRECT: tl.constexpr, AHEAD: tl.constexpr,
):
    """One (query tile, head): O rows and their base-2 LSE. Grid (query tiles, heads).

    ``AHEAD`` (config ``fwd_overlap``, see ``_OVERLAP``; TMA loads only): the key loops of
    :func:`_fwd_segment_ahead` instead of :func:`_fwd_segment` (same arithmetic, same bytes)."""
    h, col, stream, stat0, t_start, nt, i_start, ni, _, offs_m, row_ok, offs, txt_ok, img_ok = _program_tile(
        tiles_ptr, row_stride, D, BLOCK_M)
    q = _load_resident(q_txt_ptr, q_img_ptr, offs, row_ok, stream, RESIDENT_DIRECT)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if AHEAD and LOADS == 1:
        acc, m_i, l_i = _fwd_segment_ahead(acc, m_i, l_i, q, k_txt_ptr, v_txt_ptr, t_start, nt, row_stride, col,
                                           qk_scale, D, BLOCK_M, BLOCK_N, DOT_PRECISION)
        acc, m_i, l_i = _fwd_segment_ahead(acc, m_i, l_i, q, k_img_ptr, v_img_ptr, i_start, ni, row_stride, col,
                                           qk_scale, D, BLOCK_M, BLOCK_N, DOT_PRECISION)
    else:
        acc, m_i, l_i = _fwd_segment(acc, m_i, l_i, q, k_txt_ptr, v_txt_ptr, t_start, nt, row_stride, col, qk_scale,
                                     D, BLOCK_N, DOT_PRECISION, LOADS)
        acc, m_i, l_i = _fwd_segment(acc, m_i, l_i, q, k_img_ptr, v_img_ptr, i_start, ni, row_stride, col, qk_scale,
                                     D, BLOCK_N, DOT_PRECISION, LOADS)

    o = tl.math.div_rn(acc, l_i[:, None]).to(o_txt_ptr.dtype.element_ty)
    tl.store(o_txt_ptr + offs, o, mask=txt_ok)
    tl.store(o_img_ptr + offs, o, mask=img_ok)
    lse = m_i + tl.math.log2(l_i)
    tl.store(lse_ptr + (stat0 + offs_m).to(tl.int64) * n_heads + h, lse, mask=row_ok)


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


# _dkdv_segment and _dq_segment keep their own segment walks (n_full/tail, the TMA and pointer branches, the peeled
# tail; issue 9's duplicate D2): folded into shared @triton.jit walk helpers (start, load, advance) their PTX is the
# same instruction for instruction and, without line info, so is the sm_90 SASS; but Triton compiles with line info,
# the helpers' inlined scopes add $L__tmp labels around the pipelined cp.async prologue, and ptxas then allocates
# the spilling fp32 dK/dV kernel's registers differently (bf16 and the dQ kernel stayed identical).
@triton.jit
def _dkdv_segment(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, row0, n, stat0, row_stride, col, n_heads,
                  qk_scale, D: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr, LOADS: tl.constexpr,
                  STAT_BASE: tl.constexpr):
    """Query tiles of one segment, ascending from its first row; the last tile peeled (LOADS as in _fwd_segment).

    ``STAT_BASE`` (config ``stat_loads``, see ``_STAT``): how the tile's LSE and Δ entries are addressed.
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
    if LOADS == 1:
        q_desc, do_desc = _segment_descs(q_ptr, do_ptr, row0, n, row_stride, col, BLOCK_M, D)
        row = 0
        for _ in range(0, n_full):
            q, do = _load_pair(q_desc, do_desc, row)
            lse = tl.load(lse_ptr + stat)
            delta = tl.load(delta_ptr + stat)
            dk, dv = _dkdv_tile(dk, dv, k, v, q, do, lse, delta, qk_scale, DOT_PRECISION)
            row += BLOCK_M
            if STAT_BASE:
                lse_ptr += stat_step
                delta_ptr += stat_step
            else:
                stat += BLOCK_M * n_heads
        if tail > 0:
            ok = offs_m < tail
            q, do = _load_pair(q_desc, do_desc, row)
            lse = tl.load(lse_ptr + stat, mask=ok, other=float("inf"))
            delta = tl.load(delta_ptr + stat, mask=ok, other=0.0)
            dk, dv = _dkdv_tile(dk, dv, k, v, q, do, lse, delta, qk_scale, DOT_PRECISION)
    else:
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
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, LOADS: tl.constexpr,
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
                           row_stride, col, n_heads, qk_scale, D, BLOCK_M, DOT_PRECISION, LOADS, STAT_BASE)
    dk, dv = _dkdv_segment(dk, dv, k, v, q_img_ptr, do_img_ptr, lse_ptr, delta_ptr, i_start, ni, i_stat0,
                           row_stride, col, n_heads, qk_scale, D, BLOCK_M, DOT_PRECISION, LOADS, STAT_BASE)
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
                D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, LOADS: tl.constexpr):
    """Key tiles of one segment, ascending from its first row; the last tile peeled (LOADS as in _fwd_segment)."""
    n_full = n // BLOCK_N
    tail = n - n_full * BLOCK_N
    if LOADS == 1:
        k_desc, v_desc = _segment_descs(k_ptr, v_ptr, row0, n, row_stride, col, BLOCK_N, D)
        row = 0
        for _ in range(0, n_full):
            k, v = _load_pair(k_desc, v_desc, row)
            dq = _dq_tile(dq, q, do, k, v, lse, delta, qk_scale, BLOCK_N, BLOCK_N, False, DOT_PRECISION)
            row += BLOCK_N
        if tail > 0:
            k, v = _load_pair(k_desc, v_desc, row)
            dq = _dq_tile(dq, q, do, k, v, lse, delta, qk_scale, tail, BLOCK_N, True, DOT_PRECISION)
    else:
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
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, LOADS: tl.constexpr,
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
                     D, BLOCK_N, DOT_PRECISION, LOADS)
    dq = _dq_segment(dq, q, do, lse, delta, k_img_ptr, v_img_ptr, i_start, ni, row_stride, col, qk_scale,
                     D, BLOCK_N, DOT_PRECISION, LOADS)
    dq = (dq * sm_scale).to(dq_txt_ptr.dtype.element_ty)
    tl.store(dq_txt_ptr + offs, dq, mask=txt_ok)
    tl.store(dq_img_ptr + offs, dq, mask=img_ok)


# ----------------------------------------------------------------------------------------------
# Configurations: frozen per (head_dim, dtype), never keyed by batch or token counts
# ----------------------------------------------------------------------------------------------
# fwd: (BLOCK_M query rows, BLOCK_N key rows, warps, stages); dkdv: (BLOCK_M query rows stepped over,
# BLOCK_N key rows owned, warps, stages); dq: (BLOCK_M query rows owned, BLOCK_N key rows stepped over,
# warps, stages); delta: BLOCK_M rows.

_SMALL = {"fwd": (16, 16, 4, 2), "dkdv": (16, 16, 4, 2), "dq": (16, 16, 4, 2), "delta": 16}

CONFIGS: dict[tuple[int, torch.dtype], dict] = {
    # bf16 d=128 from the H200 candidate runs at 90d39bb and f02d17b (4096 + 128 tokens, B = 1): fwd 128x64/8w/3s
    # (128x128/8w 283 TFLOP/s, 4 warps 222, 2 stages 302); backward dkdv 32x128/8w/4s and dq 128x64/8w/3s: 275 TFLOP/s
    # (4-warp tiles 88). TMA descriptor loads reached 459 TFLOP/s forward vs 412 with the same bytes at f02d17b, but only
    # at a shape with no partial tile. At c68c981 (experiments/attention/c68c981) the resident tiles read directly,
    # the LSE/Δ entries through base pointers and the forward's K/V through TMA gave the frozen bytes at every
    # candidate row and passed accuracy and invariance over tails and mixed batches: fwd 416 -> 474 TFLOP/s, bwd
    # 263 -> 347 at 4096 + 128 (0.74-0.85x / 0.65-0.70x cuDNN over nine shapes). bwd_loads "tma" was slower (339).
    # With those, the 128x128 forward tile (new bytes: 128-key steps) qualified at 6ab3b56 (experiments/attention/
    # 6ab3b56/q3: accuracy, invariance pass): 474 -> 499 TFLOP/s at 4096 + 128, 0.78-0.88x cuDNN; 2 stages 375.
    # At e467669+ws (experiments/attention/e467669_ws) the warp-specialized Gluon forward (attention_ws: a TMA loader
    # warp, two consumer warpgroups taking turns on the tensor cores) gave the frozen forward's bytes and ran 561 vs 500
    # TFLOP/s at 4096 + 128 (2 K/V stages 419); frozen with fwd_kernel "ws" (the "fwd" warps entry does not apply to it).
    (128, torch.bfloat16): {"fwd": (128, 128, 8, 3), "dkdv": (32, 128, 8, 4), "dq": (128, 64, 8, 3), "delta": 64,
                            "resident_loads": "direct", "stat_loads": "base", "fwd_loads": "tma", "fwd_kernel": "ws"},
    # fp32 (IEEE FMA dots, no tensor cores): the backward's FP32 dK/dV and dQ accumulators take 8 warps
    # (4-warp tiles spilled in the bf16 candidates at 90d39bb; fp32 ran 1 TFLOP/s there with 4 warps).
    (128, torch.float32): {"fwd": (64, 32, 4, 2), "dkdv": (32, 64, 8, 2), "dq": (64, 32, 8, 2), "delta": 64},
    (64, torch.bfloat16): {"fwd": (128, 64, 4, 3), "dkdv": (32, 128, 4, 4), "dq": (128, 32, 4, 4), "delta": 64},
    (64, torch.float32): {"fwd": (64, 32, 4, 2), "dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 2), "delta": 64},
    (32, torch.bfloat16): _SMALL, (32, torch.float32): _SMALL,
    (16, torch.bfloat16): _SMALL, (16, torch.float32): _SMALL,
}
HEAD_DIMS = (16, 32, 64, 128)
# Load paths of the streamed tiles (config keys "fwd_loads", "bwd_loads"; default "pointer"); all read the same values.
_LOADS = {"pointer": 0, "tma": 1, "block_ptr": 2}
# Load of the resident tiles (Q in the forward and dQ kernels, K/V in the dK/dV kernel, dO in the dQ kernel; config key
# "resident_loads", default "select"): RESIDENT_DIRECT of _load_resident. Same values, so the same bytes.
_RESIDENT = {"select": False, "direct": True}
# Addressing of the LSE/Δ entries in the dK/dV kernel's query loop (config key "stat_loads", default "tensor"):
# STAT_BASE of _dkdv_segment. The same entries are read, so the same bytes.
_STAT = {"tensor": False, "base": True}
# Issue order of the forward's key loop (config key "fwd_overlap", default "off"; TMA forward loads only, other load
# paths ignore it): AHEAD of _attn_fwd_kernel. "pv_async" leaves each tile's P V running under the next tile's
# softmax (_fwd_segment_ahead). Same operations on the same values in the same order per tile, so the same bytes.
_OVERLAP = {"off": False, "pv_async": True}
# Forward kernel (config key "fwd_kernel", default "triton"): "ws" is the warp-specialized Gluon forward of
# attention_ws (a TMA loader warp and two consumer warpgroups that take turns on the tensor cores), "ws_free" the
# same without the turn-taking. Both compute the frozen bf16 forward's operations in its order (bf16, d = 128,
# 128 x 128 tiles only); other load paths or an unaligned base fall back to the Triton forward.
# The value is the ws kernel's turn-taking flag (PINGPONG), None for the Triton forward.
_FWD_KERNEL = {"triton": None, "ws": True, "ws_free": False}
# Register cap of the forward kernel (config key "fwd_maxnreg", default None = no cap): the ``maxnreg`` compile option
# of _attn_fwd_kernel alone (ptxas ``.maxnreg``; the backward kernels are not capped). A compile option, not
# arithmetic: the same operations on the same values, so the same bytes (ptxas may spill to local memory to meet it).
# Meant for forward tiles of which two CTAs fit on one SM (<= 128 registers a thread at 8 warps: 65,536 / (2 * 256)),
# so that one CTA's softmax runs under the other's wgmma. An int in _MAXNREG_RANGE, or None.
_MAXNREG_RANGE = (24, 255)
_DOT_PRECISION = "ieee"


def config_for(head_dim: int, dtype: torch.dtype) -> dict:
    """The frozen configuration of ``(head_dim, dtype)``; raises ValueError for an unsupported pair."""
    cfg = CONFIGS.get((head_dim, dtype))
    if cfg is None:
        raise ValueError(f"strict joint attention supports head_dim in {HEAD_DIMS} and dtypes fp32/bf16, got {head_dim}, {dtype}")
    return cfg


# ----------------------------------------------------------------------------------------------
# Host functions
# ----------------------------------------------------------------------------------------------

_TABLES: dict[tuple, tuple[torch.Tensor, int]] = {}


def _tile_table(tseq: tuple[int, ...], iseq: tuple[int, ...], block: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Device table of ``block``-row tiles cut from every sample's text and image segments; cached.

    Returns ``(table (tiles, 9) int32, tiles)``; the column meanings are listed above the kernels.
    """
    key = (tseq, iseq, block, str(device))
    hit = _TABLES.get(key)
    if hit is not None:
        return retain(hit)
    mt = sum(tseq)
    rows: list[list[int]] = []
    ts = is_ = 0
    for nt, ni in zip(tseq, iseq):
        sample = [ts, nt, is_, ni, mt + is_]
        for stream, start, n, stat in ((0, ts, nt, ts), (1, is_, ni, mt + is_)):
            for off in range(0, n, block):
                rows.append([stream, start + off, start + n, stat + off] + sample)
        ts += nt
        is_ += ni
    if max((max(r) for r in rows), default=0) >= 2**31:
        raise ValueError("strict joint attention: more than 2^31 rows")
    table = torch.tensor(rows, dtype=torch.int32).reshape(-1, 9).to(device)
    if len(_TABLES) > 1024:
        _TABLES.clear()
    _TABLES[key] = (table, len(rows))
    return retain(_TABLES[key])


_ALLOCATOR_SET = threading.local()


def _ensure_allocator() -> None:
    """Device-side tensor descriptors need global scratch: give Triton a torch-backed allocator.

    Triton keeps the allocator in a context variable, which a new thread does not inherit; autograd runs the
    backward (and a checkpointed forward's recomputation) on its own device thread, so set it once per thread.
    """
    if not getattr(_ALLOCATOR_SET, "done", False) and not _interpreting():
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        _ALLOCATOR_SET.done = True


def _load_path(name: str, *tensors: torch.Tensor) -> int:
    """The LOADS code of a configured load path; TMA falls back to pointer loads when a base is not 16-byte aligned.

    (Descriptors need 16-byte aligned bases; both paths load the same values, so the bytes do not change.)
    """
    loads = _LOADS[name]
    if loads == 1:
        if any(t.data_ptr() % 16 for t in tensors if t.numel()):
            return 0
        _ensure_allocator()
    return loads


def _option(cfg: dict, key: str, choices: dict, default: str):
    """The kernel flag of a named configuration option; ValueError for an unknown name."""
    name = cfg.get(key, default)
    if name not in choices:
        raise ValueError(f"{key} must be one of {sorted(choices)}, got {name!r}")
    return choices[name]


def _resident_direct(cfg: dict) -> bool:
    return _option(cfg, "resident_loads", _RESIDENT, "select")


def _fwd_maxnreg(cfg: dict) -> int | None:
    """The forward's register cap (config ``fwd_maxnreg``, see ``_MAXNREG_RANGE``); ValueError for a bad value."""
    cap = cfg.get("fwd_maxnreg")
    lo, hi = _MAXNREG_RANGE
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or not lo <= cap <= hi):
        raise ValueError(f"fwd_maxnreg must be None or an int in {lo}..{hi}, got {cap!r}")
    return cap


def _ws_fits(cfg: dict, dtype: torch.dtype, d: int, loads: int, *queries: torch.Tensor) -> bool:
    """Whether the warp-specialized forward serves this call: ValueError for a configuration it cannot run;
    False (the Triton forward) under the interpreter, on a GPU other than sm_90 (the kernel is Hopper wgmma), without
    Gluon, or when a base is not 16-byte aligned (same bytes on sm_90)."""
    bm, bn, _, stages = cfg["fwd"]
    if dtype != torch.bfloat16 or d != 128 or (bm, bn) != (attention_ws.BLOCK_M, 128) or not 2 <= stages <= 3:
        raise ValueError(f"fwd_kernel {cfg['fwd_kernel']!r} runs bf16, d = 128, fwd tiles (128, 128) and 2-3 stages; "
                         f"got {dtype}, d = {d}, fwd {cfg['fwd']}")
    if cfg.get("fwd_loads") != "tma":
        raise ValueError(f"fwd_kernel {cfg['fwd_kernel']!r} loads through TMA: set fwd_loads 'tma'")
    if _interpreting() or loads != 1 or any(t.data_ptr() % 16 for t in queries if t.numel()):
        return False
    return attention_ws.available() and torch.cuda.get_device_capability(queries[0].device)[0] == 9


def _launch_opts(warps: int, stages: int, maxnreg: int | None = None) -> dict:
    return launch_opts(warps, _interpreting(), num_stages=stages, maxnreg=maxnreg)


def _scales(head_dim: int) -> tuple[float, float]:
    sm_scale = 1.0 / math.sqrt(head_dim)
    return sm_scale * math.log2(math.e), sm_scale


def _seqlens(seqlens: Sequence[int], rows: int, name: str) -> tuple[int, ...]:
    try:
        out = tuple(int(n) for n in seqlens)
    except TypeError:
        raise ValueError(f"{name}: expected a sequence of ints, got {type(seqlens).__name__}") from None
    if any(int(a) != a for a in seqlens):
        raise ValueError(f"{name}: expected integer lengths, got {tuple(seqlens)}")
    if any(n < 0 for n in out):
        raise ValueError(f"{name}: lengths must be non-negative, got {out}")
    if sum(out) != rows:
        raise ValueError(f"{name} sums to {sum(out)} but the stream has {rows} rows")
    return out


def check_inputs(q_txt, k_txt, v_txt, q_img, k_img, v_img, txt_seqlens, img_seqlens) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate a call (docs/operators.md); returns the seqlens as int tuples or raises ValueError."""
    names = ("q_txt", "k_txt", "v_txt", "q_img", "k_img", "v_img")
    tensors = (q_txt, k_txt, v_txt, q_img, k_img, v_img)
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"expected {name} of shape (rows, H, d), got {getattr(t, 'shape', type(t).__name__)}")
    dtype, device = q_img.dtype, q_img.device
    if dtype not in _DTYPES:
        raise ValueError(f"strict joint attention runs fp32 or bf16, got {dtype}")
    if device.type != "cuda" and not (_interpreting() and device.type == "cpu"):
        raise ValueError(f"the triton joint attention needs CUDA tensors (CPU only under TRITON_INTERPRET=1), got {device}")
    heads, head_dim = q_img.shape[1:]
    config_for(head_dim, dtype)
    for name, t in zip(names, tensors):
        if t.shape[1:] != (heads, head_dim):
            raise ValueError(f"expected {name} of shape (rows, {heads}, {head_dim}), got {tuple(t.shape)}")
        check_operand(name, t, dtype, device, dtype_of="q_img's", layout="rows, H, d")
    if not (q_txt.shape == k_txt.shape == v_txt.shape):
        raise ValueError(f"q_txt, k_txt, v_txt must have one shape, got {tuple(q_txt.shape)}, {tuple(k_txt.shape)}, {tuple(v_txt.shape)}")
    if not (q_img.shape == k_img.shape == v_img.shape):
        raise ValueError(f"q_img, k_img, v_img must have one shape, got {tuple(q_img.shape)}, {tuple(k_img.shape)}, {tuple(v_img.shape)}")
    tseq = _seqlens(txt_seqlens, q_txt.shape[0], "txt_seqlens")
    iseq = _seqlens(img_seqlens, q_img.shape[0], "img_seqlens")
    if len(tseq) != len(iseq):
        raise ValueError(f"txt_seqlens has {len(tseq)} samples but img_seqlens has {len(iseq)}")
    if len(tseq) == 0:
        raise ValueError("strict joint attention needs at least one sample")
    return tseq, iseq


def _sample_tiles(tseq, iseq, block: int, device: torch.device, only_sample: int | None) -> tuple[torch.Tensor, int]:
    table, n = _tile_table(tseq, iseq, block, device)
    if only_sample is None:
        return table, n
    keep = (table[:, 4] == sum(tseq[:only_sample])) & (table[:, 6] == sum(iseq[:only_sample]))
    table = table[keep].contiguous()
    return table, table.shape[0]


def attention_fwd(q_txt, k_txt, v_txt, q_img, k_img, v_img, tseq, iseq, cfg: dict | None = None, *,
                  out: tuple | None = None, only_sample: int | None = None):
    """Forward on validated inputs. Returns ``(o_txt (Mt, H, d), o_img (Mi, H, d), lse (Mt+Mi, H) fp32)``.

    ``cfg`` overrides the frozen configuration (benchmark candidates only). ``out`` (o_txt, o_img, lse)
    and ``only_sample`` (launch the tiles of that sample alone) exist for the tests that prove no
    program writes outside its own sample's rows.
    """
    heads, d = q_img.shape[1:]
    cfg = cfg or config_for(d, q_img.dtype)
    bm, bn, warps, stages = cfg["fwd"]
    maxnreg = _fwd_maxnreg(cfg)
    loads = _load_path(cfg.get("fwd_loads", "pointer"), k_txt, k_img, v_txt, v_img)
    if out is None:
        out = (torch.empty_like(q_txt), torch.empty_like(q_img),
               torch.empty((q_txt.shape[0] + q_img.shape[0], heads), dtype=torch.float32, device=q_img.device))
    o_txt, o_img, lse = out
    table, n_tiles = _sample_tiles(tseq, iseq, bm, q_img.device, only_sample)
    pingpong = _option(cfg, "fwd_kernel", _FWD_KERNEL, "triton")
    qk_scale, _ = _scales(d)
    if pingpong is not None and n_tiles and _ws_fits(cfg, q_img.dtype, d, loads, q_txt, q_img):
        attention_ws.launch(q_txt, k_txt, v_txt, q_img, k_img, v_img, o_txt, o_img, lse, table, n_tiles, heads, d,
                            qk_scale, bn, stages, pingpong)
    elif n_tiles:
        _attn_fwd_kernel[(n_tiles, heads)](
            q_txt, k_txt, v_txt, q_img, k_img, v_img, o_txt, o_img, lse, table,
            heads * d, heads, qk_scale,
            D=d, BLOCK_M=bm, BLOCK_N=bn, DOT_PRECISION=_DOT_PRECISION, LOADS=loads,
            RESIDENT_DIRECT=_resident_direct(cfg), AHEAD=_option(cfg, "fwd_overlap", _OVERLAP, "off"),
            **_launch_opts(warps, stages, maxnreg))
    return o_txt, o_img, lse


def attention_bwd(do_txt, do_img, q_txt, k_txt, v_txt, q_img, k_img, v_img, o_txt, o_img, lse, tseq, iseq,
                  cfg: dict | None = None, *, out: tuple | None = None, only_sample: int | None = None):
    """Backward: ``(dq_txt, dk_txt, dv_txt, dq_img, dk_img, dv_img)``, each like its input.

    do_*, o_*: ``(M, H, d)`` contiguous in the input dtype; lse from :func:`attention_fwd`. ``out`` and
    ``only_sample`` as in :func:`attention_fwd` (tests only).
    """
    heads, d = q_img.shape[1:]
    cfg = cfg or config_for(d, q_img.dtype)
    dev = q_img.device
    qk_scale, sm_scale = _scales(d)
    delta = torch.empty_like(lse)
    bm_d = cfg["delta"]
    table, n = _sample_tiles(tseq, iseq, bm_d, dev, only_sample)
    if n:
        _bwd_delta_kernel[(n, heads)](o_txt, o_img, do_txt, do_img, delta, table, heads * d, heads,
                                      D=d, BLOCK_M=bm_d, **_launch_opts(4, 1))
    if out is None:
        out = tuple(torch.empty_like(t) for t in (q_txt, k_txt, v_txt, q_img, k_img, v_img))
    dq_txt, dk_txt, dv_txt, dq_img, dk_img, dv_img = out
    loads = _load_path(cfg.get("bwd_loads", "pointer"), q_txt, q_img, do_txt, do_img, k_txt, k_img, v_txt, v_img)
    bm, bn, warps, stages = cfg["dkdv"]
    table, n = _sample_tiles(tseq, iseq, bn, dev, only_sample)
    if n:
        _attn_bwd_dkdv_kernel[(n, heads)](
            q_txt, k_txt, v_txt, q_img, k_img, v_img, do_txt, do_img, dk_txt, dv_txt, dk_img, dv_img, lse, delta, table,
            heads * d, heads, qk_scale, sm_scale,
            D=d, BLOCK_M=bm, BLOCK_N=bn, DOT_PRECISION=_DOT_PRECISION, LOADS=loads,
            RESIDENT_DIRECT=_resident_direct(cfg), STAT_BASE=_option(cfg, "stat_loads", _STAT, "tensor"),
            **_launch_opts(warps, stages))
    bm, bn, warps, stages = cfg["dq"]
    table, n = _sample_tiles(tseq, iseq, bm, dev, only_sample)
    if n:
        _attn_bwd_dq_kernel[(n, heads)](
            q_txt, k_txt, v_txt, q_img, k_img, v_img, do_txt, do_img, dq_txt, dq_img, lse, delta, table,
            heads * d, heads, qk_scale, sm_scale,
            D=d, BLOCK_M=bm, BLOCK_N=bn, DOT_PRECISION=_DOT_PRECISION, LOADS=loads,
            RESIDENT_DIRECT=_resident_direct(cfg), **_launch_opts(warps, stages))
    return out


class JointAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: gradients for the six q/k/v inputs (no atomics; see the module docstring)."""

    @staticmethod
    def forward(ctx, q_txt, k_txt, v_txt, q_img, k_img, v_img, tseq, iseq, cfg):
        o_txt, o_img, lse = attention_fwd(q_txt, k_txt, v_txt, q_img, k_img, v_img, tseq, iseq, cfg)
        ctx.save_for_backward(q_txt, k_txt, v_txt, q_img, k_img, v_img, o_txt, o_img, lse)
        ctx.meta = (tseq, iseq, cfg)
        return o_txt.view(o_txt.shape[0], -1), o_img.view(o_img.shape[0], -1)

    @staticmethod
    def backward(ctx, do_txt, do_img):
        q_txt, k_txt, v_txt, q_img, k_img, v_img, o_txt, o_img, lse = ctx.saved_tensors
        tseq, iseq, cfg = ctx.meta
        do_txt = torch.zeros_like(o_txt) if do_txt is None else do_txt.reshape(o_txt.shape).contiguous()
        do_img = torch.zeros_like(o_img) if do_img is None else do_img.reshape(o_img.shape).contiguous()
        grads = attention_bwd(do_txt, do_img, q_txt, k_txt, v_txt, q_img, k_img, v_img, o_txt, o_img, lse, tseq, iseq, cfg)
        return (*grads, None, None, None)


def joint_attention_fused(
    q_txt: torch.Tensor, k_txt: torch.Tensor, v_txt: torch.Tensor,
    q_img: torch.Tensor, k_img: torch.Tensor, v_img: torch.Tensor, *,
    txt_seqlens: Sequence[int], img_seqlens: Sequence[int], config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed joint attention (docs/operators.md).

    q/k/v_txt: ``(Mt, H, d)``, q/k/v_img: ``(Mi, H, d)``, one dtype (fp32 | bf16), contiguous, on CUDA;
    ``txt_seqlens``/``img_seqlens``: rows per sample in each stream (one entry per sample each).
    Returns ``(o_txt (Mt, H·d), o_img (Mi, H·d))`` in the input dtype; differentiable in all six inputs.
    ``config`` replaces the frozen configuration (benchmark candidates only; not for model use).
    """
    tseq, iseq = check_inputs(q_txt, k_txt, v_txt, q_img, k_img, v_img, txt_seqlens, img_seqlens)
    if config is not None:
        config = dict(config)
    tensors = (q_txt, k_txt, v_txt, q_img, k_img, v_img)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return JointAttentionFunction.apply(*tensors, tseq, iseq, config)
    o_txt, o_img, _ = attention_fwd(*tensors, tseq, iseq, config)
    return o_txt.view(o_txt.shape[0], -1), o_img.view(o_img.shape[0], -1)


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------

REDUCTION_ORDER = (
    "per sample: text and image segments tiled from their own first rows; each query tile walks the sample's "
    "key tiles text-ascending then image-ascending (online softmax, exp2, FP32 max/sum, last tile peeled and "
    "masked -inf); bwd: dK/dV per key tile over query tiles in the same order, dQ per query tile over key tiles; "
    "no split-KV, no atomics; config per (head_dim, dtype)"
)

register(KernelImpl(
    op="joint_attention_fused", backend="triton", device="cuda", dtypes=frozenset(_DTYPES), fn=joint_attention_fused,
    strict=True, split_k=False,
    kernel_name="_attn_fwd_ws_kernel/_attn_fwd_kernel/_bwd_delta_kernel/_attn_bwd_dkdv_kernel/_attn_bwd_dq_kernel",
    source=(sys.modules[__name__], attention_ws),
    config={"table": "mmdit_strict.kernels.triton.attention.CONFIGS", "keyed_by": "(head_dim, dtype)",
            "dot_precision": _DOT_PRECISION, "fp_fusion": False,
            "bf16_d128": {k: list(v) if isinstance(v, tuple) else v for k, v in CONFIGS[(128, torch.bfloat16)].items()}},
    reduction_order=REDUCTION_ORDER, accumulator="fp32",
))

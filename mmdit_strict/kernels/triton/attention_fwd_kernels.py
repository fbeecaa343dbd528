"""Forward kernel of the strict joint attention (Triton) and the tile helpers the backward shares.

Contract and arithmetic: :mod:`.attention` (the host side: configuration table, launchers, autograd, registry).
One program per (query tile, head): the tile's resident Q rows, then the sample's key tiles in the joint order
(text tiles ascending, then image tiles ascending), each segment's last tile peeled and masked (score −inf),
online softmax in FP32 base 2, ``O = acc / l`` (IEEE) and ``lse = m + log2(l)`` stored.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Tile table: one int32 row of 9 columns per tile (built by attention._tile_table):
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

    ``DIRECT`` (:attr:`AttentionConfig.resident_direct`): False, two masked loads (one per stream) merged with
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
def _row_ptrs(base_ptr, row0, row_stride, col, ROWS: tl.constexpr, D: tl.constexpr):
    """(ROWS, D) pointers to rows row0.. of one head's columns ``col .. col+D`` (64-bit row offsets)."""
    rows = (row0 + tl.arange(0, ROWS)).to(tl.int64)
    return base_ptr + rows[:, None] * row_stride + col + tl.arange(0, D)[None, :]


@triton.jit
def _fwd_segment(acc, m_i, l_i, q, k_ptr, v_ptr, row0, n, row_stride, col, qk_scale,
                 D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Key tiles of one segment (rows ``row0 .. row0+n`` of one stream), ascending; last tile peeled.

    ``TMA`` (:attr:`AttentionConfig.fwd_tma`): False, pointer loads, masked on the last tile; True, device-side
    tensor descriptors spanning exactly the segment (:func:`_segment_desc`: the last tile's rows past the
    segment's end arrive as zeros). Both read the same values: the tail's missing rows are 0 in K and V either
    way and their columns get score −inf, so the arithmetic and the result bytes are the same.
    """
    n_full = n // BLOCK_N
    tail = n - n_full * BLOCK_N
    if TMA:
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
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    RESIDENT_DIRECT: tl.constexpr,
):
    """One (query tile, head): O rows and their base-2 LSE. Grid (query tiles, heads)."""
    h, col, stream, stat0, t_start, nt, i_start, ni, _, offs_m, row_ok, offs, txt_ok, img_ok = _program_tile(
        tiles_ptr, row_stride, D, BLOCK_M)
    q = _load_resident(q_txt_ptr, q_img_ptr, offs, row_ok, stream, RESIDENT_DIRECT)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    acc, m_i, l_i = _fwd_segment(acc, m_i, l_i, q, k_txt_ptr, v_txt_ptr, t_start, nt, row_stride, col, qk_scale,
                                 D, BLOCK_N, DOT_PRECISION, TMA)
    acc, m_i, l_i = _fwd_segment(acc, m_i, l_i, q, k_img_ptr, v_img_ptr, i_start, ni, row_stride, col, qk_scale,
                                 D, BLOCK_N, DOT_PRECISION, TMA)

    o = tl.math.div_rn(acc, l_i[:, None]).to(o_txt_ptr.dtype.element_ty)
    tl.store(o_txt_ptr + offs, o, mask=txt_ok)
    tl.store(o_img_ptr + offs, o, mask=img_ok)
    lse = m_i + tl.math.log2(l_i)
    tl.store(lse_ptr + (stat0 + offs_m).to(tl.int64) * n_heads + h, lse, mask=row_ok)

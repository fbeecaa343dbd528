"""Warp-specialized forward of the strict joint attention (Gluon, Hopper): :attr:`AttentionConfig.fwd_ws`.

The same arithmetic as ``attention_fwd_kernels._attn_fwd_kernel`` on its frozen bf16 tiles (128 query rows, 128-key
steps, TMA loads), scheduled differently. One program = one (query tile, head), as there, split into
three partitions that talk through mbarriers instead of CTA-wide barriers:

* a **loader** warp issues the TMA copies: the query tile's two 64-row halves once, then every key tile's
  K and V boxes, in the forward's key order (the sample's text tiles ascending, then its image tiles), into a
  ring of ``STAGES`` shared-memory slots. Every descriptor spans exactly one segment (as in
  ``attention_fwd_kernels._segment_desc``), so a box's rows past the segment arrive as zeros and no other sample's row
  can be read.
* two **consumer** warpgroups, one per 64-row half of the query tile. Each runs the online softmax of its
  rows over all key tiles. Per key tile ``j`` it issues ``acc·α_{j-1} + P̃_{j-1} V_{j-1}`` and
  ``S_j = Q K_jᵀ`` together on the tensor cores, waits for both, frees slot ``j-1`` and computes the
  statistics of ``S_j``.
* **ping-pong**: the two consumers take turns to issue their tensor-core work (a pair of
  mbarriers passes the turn), so one warpgroup's softmax runs while the other's products do. Without
  warp specialization the two halves of the 8-warp kernel run in lockstep, and the tensor cores idle
  during every softmax.

Why the bytes equal the frozen kernel's: each consumer's wgmma layout is the frozen kernel's per-warpgroup
layout (64×128 accumulator, ``m64n128k16`` instructions, K ascending), and its row statistics are the same
operations in the same order: ``m' = max(m, rowmax(S)·c)``, ``P = exp2(fma(S, c, −m'))``,
``α = exp2(m − m')``, ``l = l·α + rowsum(P)`` (the in-thread sum then the two lane butterflies of that
layout), ``acc = acc·α + P̃ V`` with ``P̃ = bf16(P)``, ``O = acc / l`` (IEEE), ``lse = m + log2(l)``;
a segment's last partial tile scores its missing columns ``−inf``. Compiled with ``enable_fp_fusion=False``.
Only the issue order differs, and no tile, loop bound or mask depends on anything but the sample's own
lengths.

Requires Triton's Gluon (``triton.experimental.gluon``) and an sm_90 GPU; the interpreter cannot run it.
"""

from __future__ import annotations

try:  # Gluon ships with Triton >= 3.4; the strict path falls back to the Triton forward without it.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
except ImportError:  # pragma: no cover - exercised only with an old Triton
    gluon = None

HALF = 64  # query rows per consumer warpgroup (the wgmma M of one warpgroup)
BLOCK_M = 2 * HALF
CONSUMER_REGS = 240  # registers per thread of the second consumer (the first takes what the kernel's cap leaves)
LOADER_REGS = 24
MAXNREG = 168  # kernel-wide cap: 12 warps x 32 threads x 168 <= 65,536 registers


def available() -> bool:
    """True when this Triton has the Gluon front end the warp-specialized forward is written in."""
    return gluon is not None


if gluon is not None:
    _HALF = gl.constexpr(HALF)
    _REGS = gl.constexpr([CONSUMER_REGS, LOADER_REGS])

    @gluon.jit
    def _ws_loader(q_desc, kt_desc, vt_desc, ki_desc, vi_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty,
                   q_row, nt, ni, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """TMA issue: the query tile's two halves, then K/V of every key tile (text, then image) into the ring."""
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem.index(0))
        tma.async_copy_global_to_shared(q_desc, [q_row + _HALF, 0], q_bar, q_smem.index(1))
        _ws_ring(kt_desc, vt_desc, ki_desc, vi_desc, k_bufs, v_bufs, ready, empty, nt, ni, BLOCK_N, STAGES)

    @gluon.jit
    def _ws_ring(at_desc, bt_desc, ai_desc, bi_desc, a_bufs, b_bufs, ready, empty, nt, ni, ROWS: gl.constexpr,
                 STAGES: gl.constexpr):
        """Stream two tensors' ``ROWS``-row boxes, the text segment's tiles then the image segment's, ascending,
        into a ring of ``STAGES`` slots: wait for the slot to be free, then one ``ready`` barrier for both boxes."""
        n_txt = gl.cdiv(nt, ROWS)
        n_all = n_txt + gl.cdiv(ni, ROWS)
        for c in range(n_all):
            slot = c % STAGES
            mbarrier.wait(empty.index(slot), ((c // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, 2 * at_desc.block_type.nbytes)
            if c < n_txt:
                row = c * ROWS
                tma.async_copy_global_to_shared(at_desc, [row, 0], bar, a_bufs.index(slot))
                tma.async_copy_global_to_shared(bt_desc, [row, 0], bar, b_bufs.index(slot))
            else:
                row = (c - n_txt) * ROWS
                tma.async_copy_global_to_shared(ai_desc, [row, 0], bar, a_bufs.index(slot))
                tma.async_copy_global_to_shared(bi_desc, [row, 0], bar, b_bufs.index(slot))

    @gluon.jit
    def _ws_softmax(m_i, l_i, s, qk_scale):
        """``attention_fwd_kernels._fwd_stats`` in the consumer's layout: P (FP32), α, the new row max and row sum."""
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(gl.fma(s, qk_scale, -gl.expand_dims(m_new, 1)))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _ws_stats(m_i, l_i, s, qk_scale, n_valid, BLOCK_N: gl.constexpr, layout: gl.constexpr):
        """The statistics of one key tile; a segment's last partial tile scores its missing columns −inf.

        The two cases are separate branches (a tile is masked or not as a whole), so full tiles pay no select.
        """
        if n_valid < BLOCK_N:
            cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
            p, alpha, m_i, l_i = _ws_softmax(m_i, l_i, gl.where(gl.expand_dims(cols, 0) < n_valid, s, float("-inf")),
                                             qk_scale)
        else:
            p, alpha, m_i, l_i = _ws_softmax(m_i, l_i, s, qk_scale)
        return p, alpha, m_i, l_i

    @gluon.jit
    def _ws_turn(turn, wg, k):
        """Wait for this consumer's ``k``-th turn to issue tensor-core work (consumer 0 goes first)."""
        mbarrier.wait(turn.index(wg), (k & 1) ^ (1 - wg))

    @gluon.jit
    def _ws_pass(turn, wg):
        """Hand the turn to the other consumer."""
        mbarrier.arrive(turn.index(1 - wg), count=1)

    @gluon.jit
    def _ws_valid(c, n_txt, nt, ni, BLOCK_N: gl.constexpr):
        """Valid key rows of flat key tile ``c`` (text tiles first): BLOCK_N except a segment's last tile."""
        seg_n = gl.where(c < n_txt, nt, ni)
        first = gl.where(c < n_txt, c, c - n_txt) * BLOCK_N
        return gl.minimum(seg_n - first, BLOCK_N)

    @gluon.jit
    def _ws_consumer(wg, q_smem, k_bufs, v_bufs, q_bar, ready, empty, turn, o_txt_ptr, o_img_ptr, lse_ptr,
                     stream, row0, seg_end, stat0, nt, ni, col, h, row_stride, n_heads, qk_scale,
                     D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """One 64-row half of the query tile over every key tile; stores its O rows and base-2 LSE."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        rows_l: gl.constexpr = gl.SliceLayout(1, mma)
        m_i = gl.full([_HALF], float("-inf"), gl.float32, rows_l)
        l_i = gl.zeros([_HALF], gl.float32, rows_l)
        acc = gl.zeros([_HALF, D], gl.float32, mma)
        zero_s = gl.zeros([_HALF, BLOCK_N], gl.float32, mma)
        q = q_smem.index(wg)
        n_txt = gl.cdiv(nt, BLOCK_N)
        n_all = n_txt + gl.cdiv(ni, BLOCK_N)
        mbarrier.wait(q_bar, 0)

        # key tile 0: scores and statistics
        mbarrier.wait(ready.index(0), 0)
        _ws_turn(turn, wg, 0)
        s = warpgroup_mma(q, k_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        _ws_pass(turn, wg)
        s = warpgroup_mma_wait(0, deps=(s,))
        p, alpha, m_i, l_i = _ws_stats(m_i, l_i, s, qk_scale, _ws_valid(0, n_txt, nt, ni, BLOCK_N), BLOCK_N, mma)
        for c in range(1, n_all):
            prev = (c - 1) % STAGES
            slot = c % STAGES
            mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
            _ws_turn(turn, wg, c)
            acc = acc * gl.expand_dims(alpha, 1)
            acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_bufs.index(prev), acc, is_async=True)
            s = warpgroup_mma(q, k_bufs.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            _ws_pass(turn, wg)
            acc, s = warpgroup_mma_wait(0, deps=(acc, s))
            mbarrier.arrive(empty.index(prev), count=1)
            p, alpha, m_i, l_i = _ws_stats(m_i, l_i, s, qk_scale, _ws_valid(c, n_txt, nt, ni, BLOCK_N), BLOCK_N, mma)
        last = (n_all - 1) % STAGES
        _ws_turn(turn, wg, n_all)
        acc = acc * gl.expand_dims(alpha, 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_bufs.index(last), acc, is_async=True)
        _ws_pass(turn, wg)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(last), count=1)

        offs_m = wg * _HALF + gl.arange(0, _HALF, layout=rows_l)
        rows = row0 + offs_m
        row_ok = rows < seg_end
        cols = col + gl.arange(0, D, layout=gl.SliceLayout(0, mma))
        offs = gl.expand_dims(rows.to(gl.int64) * row_stride, 1) + gl.expand_dims(cols, 0)
        o = gl.div_rn(acc, gl.expand_dims(l_i, 1)).to(o_txt_ptr.dtype.element_ty)
        ok, _ = gl.broadcast(gl.expand_dims(row_ok, 1), offs)  # the row mask over every column
        if stream == 0:
            gl.store(o_txt_ptr + offs, o, mask=ok)
        else:
            gl.store(o_img_ptr + offs, o, mask=ok)
        lse = m_i + gl.log2(l_i)
        gl.store(lse_ptr + (stat0 + offs_m).to(gl.int64) * n_heads + h, lse, mask=row_ok)

    @gluon.jit
    def _ws_tile_row(tiles_ptr):
        """This program's row of the tile table (``attention_fwd_kernels`` lists the nine columns)."""
        t = tiles_ptr + gl.program_id(0) * 9
        return (gl.load(t), gl.load(t + 1), gl.load(t + 2), gl.load(t + 3), gl.load(t + 4), gl.load(t + 5),
                gl.load(t + 6), gl.load(t + 7), gl.load(t + 8))

    @gluon.jit
    def _ws_barriers(STAGES: gl.constexpr):
        """The partitions' mbarriers: one for the resident tiles (one arrival), the ring's ``ready`` (one arrival,
        the TMA bytes) and ``empty`` (both consumers) per slot, and the two consumers' turns."""
        bars: gl.constexpr = mbarrier.MBarrierLayout()
        once = gl.allocate_shared_memory(gl.int64, [1], bars)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bars)
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bars)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], bars)
        mbarrier.init(once, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        return once, ready, empty, turn

    @gluon.jit
    def _ws_desc(base_ptr, row0, n, row_stride, col, ROWS: gl.constexpr, D: gl.constexpr):
        """TMA descriptor over exactly one segment (``attention_fwd_kernels._segment_desc``): rows past it read as zeros."""
        layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        return tma.make_tensor_descriptor(base_ptr + row0.to(gl.int64) * row_stride + col, shape=[gl.maximum(n, 1), D],
                                          strides=[row_stride, 1], block_shape=[ROWS, D], layout=layout)

    @gluon.jit
    def _attn_fwd_ws_kernel(
        q_txt_ptr, k_txt_ptr, v_txt_ptr, q_img_ptr, k_img_ptr, v_img_ptr, o_txt_ptr, o_img_ptr, lse_ptr, tiles_ptr,
        row_stride, n_heads, qk_scale,
        D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    ):
        """One (query tile of 128 rows, head); grid (query tiles, heads); 4 warps + 4 + 1 worker warps."""
        h = gl.program_id(1)
        stream, row0, seg_end, stat0, t_start, nt, i_start, ni, _ = _ws_tile_row(tiles_ptr)
        col = h * D
        seg0 = gl.where(stream == 0, t_start, i_start)

        smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, _HALF, D], smem)
        k_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], smem)
        v_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], smem)
        q_bar, ready, empty, turn = _ws_barriers(STAGES)

        q_base = gl.where(stream == 0, q_txt_ptr, q_img_ptr)
        q_desc = _ws_desc(q_base, seg0, seg_end - seg0, row_stride, col, _HALF, D)
        kt_desc = _ws_desc(k_txt_ptr, t_start, nt, row_stride, col, BLOCK_N, D)
        vt_desc = _ws_desc(v_txt_ptr, t_start, nt, row_stride, col, BLOCK_N, D)
        ki_desc = _ws_desc(k_img_ptr, i_start, ni, row_stride, col, BLOCK_N, D)
        vi_desc = _ws_desc(v_img_ptr, i_start, ni, row_stride, col, BLOCK_N, D)

        gl.warp_specialize([
            (_ws_consumer, (gl.constexpr(0), q_smem, k_bufs, v_bufs, q_bar, ready, empty, turn, o_txt_ptr, o_img_ptr,
                            lse_ptr, stream, row0, seg_end, stat0, nt, ni, col, h, row_stride, n_heads, qk_scale,
                            D, BLOCK_N, STAGES)),
            (_ws_consumer, (gl.constexpr(1), q_smem, k_bufs, v_bufs, q_bar, ready, empty, turn, o_txt_ptr, o_img_ptr,
                            lse_ptr, stream, row0, seg_end, stat0, nt, ni, col, h, row_stride, n_heads, qk_scale,
                            D, BLOCK_N, STAGES)),
            (_ws_loader, (q_desc, kt_desc, vt_desc, ki_desc, vi_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty,
                          row0 - seg0, nt, ni, BLOCK_N, STAGES)),
        ], [4, 1], _REGS)


def launch(q_txt, k_txt, v_txt, q_img, k_img, v_img, o_txt, o_img, lse, table, n_tiles: int, heads: int, d: int,
           qk_scale: float, block_n: int, stages: int) -> None:
    """Run the warp-specialized forward over ``table``'s 128-row query tiles (grid ``(n_tiles, heads)``).

    The caller (``attention.attention_fwd``) has validated the inputs, built the tile table and set Triton's
    allocator (device-side descriptors need global scratch); see there for the shapes.
    """
    if gluon is None:
        raise RuntimeError("the warp-specialized forward needs Triton's Gluon front end (triton.experimental.gluon)")
    _attn_fwd_ws_kernel[(n_tiles, heads)](
        q_txt, k_txt, v_txt, q_img, k_img, v_img, o_txt, o_img, lse, table, heads * d, heads, qk_scale,
        D=d, BLOCK_N=block_n, STAGES=stages,
        num_warps=4, maxnreg=MAXNREG, enable_fp_fusion=False)

"""Warp-specialized dK/dV kernel of the strict joint attention (Gluon, Hopper): :attr:`AttentionConfig.bwd_ws`.

The same arithmetic as ``attention_bwd_kernels._attn_bwd_dkdv_kernel`` on its bf16 tiles (128 key rows per program,
``BLOCK_M`` query rows a step), scheduled differently. One program = one (key tile, head), as there, split into
three partitions that talk through mbarriers:

* a **loader** warp issues the TMA copies: the key tile's K and V (two 64-row halves each) once, then the Q and dO
  boxes of every query tile of the sample, in the Triton kernel's order (text tiles ascending, then image tiles),
  into a ring of ``STAGES`` shared-memory slots. Every descriptor spans exactly one segment, so a box's rows past
  the segment arrive as zeros (the Triton kernel's masked loads give the same zeros) and no other sample's row can
  be read.
* two **consumer** warpgroups, one per 64-row half of the key tile, each owning its half's dK and dV. Everything
  is key-major, as in the Triton kernel. Per query tile ``j`` a consumer issues ``dV += P̃_{j-1} dO_{j-1}`` and
  ``dK += dS̃_{j-1} Q_{j-1}`` together with ``Sᵀ_j = K Q_jᵀ`` and ``dPᵀ_j = V dO_jᵀ``, waits for all four, frees
  slot ``j-1`` and computes ``P = exp2(fma(Sᵀ, c, −lse))`` and ``dS = P ∘ (dPᵀ − Δ)`` for tile ``j``. The LSE and
  Δ entries of tile ``j+1`` are loaded while tile ``j``'s products run (loaded just before their use, they left
  the kernel slower than the Triton one: ``experiments/attention/3bd0f57_bwd_ws``).
* the two consumers take turns to issue their tensor-core work (the forward's ping-pong), so one warpgroup's
  elementwise work runs while the other's products do.

Why the bytes equal the Triton kernel's: with 8 warps Triton gives each warpgroup 64 of the tile's key rows for every
product, the layout used here; each product is the same chain of ``k16`` wgmma steps in ascending order (K = d for
Sᵀ and dPᵀ, K = the query step for dV and dK, whose accumulators run over the query tiles in the same order), and the
elementwise operations are the same FP32 operations (compiled with ``enable_fp_fusion=False``; the written ``fma``
fuses). The issue order of independent products differs, which no element sees. Masked query rows read Q = dO = 0
with ``lse = +inf`` and ``Δ = 0``, so they add exact zeros, as in the Triton kernel.

Requires Triton's Gluon (``triton.experimental.gluon``) and an sm_90 GPU; the interpreter cannot run it.
"""

from __future__ import annotations

from . import attention_ws

try:  # Gluon ships with Triton >= 3.4; without it the Triton dK/dV kernel serves every call.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
except ImportError:  # pragma: no cover - exercised only with an old Triton
    gluon = None

HALF = 64  # key rows per consumer warpgroup (the wgmma M of one warpgroup)
BLOCK_N = 2 * HALF
BLOCK_MS = (32, 64)  # query rows a step this kernel is built for
CONSUMER_REGS = 240
LOADER_REGS = 24
MAXNREG = 168  # kernel-wide cap: 12 warps x 32 threads x 168 <= 65,536 registers
SMEM_BYTES = 232448  # shared memory one block may use on sm_90


def max_stages(block_m: int, d: int = 128) -> int:
    """The most ring slots that fit beside K and V: each slot holds a Q and a dO box (bf16), plus barriers."""
    return (SMEM_BYTES - 1024 - 2 * BLOCK_N * d * 2) // (2 * block_m * d * 2)


def available() -> bool:
    """True when this Triton has the Gluon front end the kernel is written in."""
    return gluon is not None and attention_ws.available()


if gluon is not None:
    from .attention_ws import _ws_barriers, _ws_desc, _ws_pass, _ws_ring, _ws_tile_row, _ws_turn

    _HALF = gl.constexpr(HALF)
    _REGS = gl.constexpr([CONSUMER_REGS, LOADER_REGS])

    @gluon.jit
    def _bwd_loader(k_desc, v_desc, qt_desc, dot_desc, qi_desc, doi_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar,
                    ready, empty, key_row, nt, ni, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
        """TMA issue: K and V of the key tile (two halves each), then Q and dO of every query tile into the ring."""
        mbarrier.expect(kv_bar, 4 * k_desc.block_type.nbytes)
        for i in gl.static_range(2):
            tma.async_copy_global_to_shared(k_desc, [key_row + i * _HALF, 0], kv_bar, k_smem.index(i))
            tma.async_copy_global_to_shared(v_desc, [key_row + i * _HALF, 0], kv_bar, v_smem.index(i))
        _ws_ring(qt_desc, dot_desc, qi_desc, doi_desc, q_bufs, do_bufs, ready, empty, nt, ni, BLOCK_M, STAGES)

    @gluon.jit
    def _bwd_stats(lse_ptr, delta_ptr, c, n_txt, nt, ni, t_start, i_stat0, h, n_heads, BLOCK_M: gl.constexpr,
                   layout: gl.constexpr):
        """LSE and Δ of query tile ``c``'s rows (this head); rows past the segment read lse = +inf and Δ = 0."""
        txt = c < n_txt
        first = gl.where(txt, c, c - n_txt) * BLOCK_M
        offs = gl.arange(0, BLOCK_M, layout=layout)
        ok = first + offs < gl.where(txt, nt, ni)
        idx = (gl.where(txt, t_start, i_stat0) + first + offs).to(gl.int64) * n_heads + h
        lse = gl.load(lse_ptr + idx, mask=ok, other=float("inf"))
        delta = gl.load(delta_ptr + idx, mask=ok, other=0.0)
        return lse, delta

    @gluon.jit
    def _bwd_ds(s, dp, lse, delta, qk_scale, op_layout: gl.constexpr):
        """``P = exp2(fma(Sᵀ, c, −lse))`` and ``dS = P ∘ (dPᵀ − Δ)`` in FP32, each rounded to bf16 as a product operand."""
        p = gl.exp2(gl.fma(s, qk_scale, -gl.expand_dims(lse, 0)))
        ds = p * (dp - gl.expand_dims(delta, 0))
        return gl.convert_layout(p.to(gl.bfloat16), op_layout), gl.convert_layout(ds.to(gl.bfloat16), op_layout)

    @gluon.jit
    def _bwd_consumer(wg, k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty, turn,
                      dk_txt_ptr, dv_txt_ptr, dk_img_ptr, dv_img_ptr, lse_ptr, delta_ptr,
                      stream, row0, seg_end, t_start, nt, ni, i_stat0, col, h, row_stride, n_heads, qk_scale, sm_scale,
                      D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
        """One 64-row half of the key tile over every query tile; stores its dK (scaled) and dV rows."""
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
        mma_d: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        op_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_d, k_width=2)
        stat_l: gl.constexpr = gl.SliceLayout(0, mma_s)
        dk = gl.zeros([_HALF, D], gl.float32, mma_d)
        dv = gl.zeros([_HALF, D], gl.float32, mma_d)
        zero_s = gl.zeros([_HALF, BLOCK_M], gl.float32, mma_s)
        k = k_smem.index(wg)
        v = v_smem.index(wg)
        n_txt = gl.cdiv(nt, BLOCK_M)
        n_all = n_txt + gl.cdiv(ni, BLOCK_M)
        mbarrier.wait(kv_bar, 0)

        # query tile 0: Sᵀ, dPᵀ and the elementwise part
        lse, delta = _bwd_stats(lse_ptr, delta_ptr, 0, n_txt, nt, ni, t_start, i_stat0, h, n_heads, BLOCK_M, stat_l)
        mbarrier.wait(ready.index(0), 0)
        _ws_turn(turn, wg, 0)
        s = warpgroup_mma(k, q_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp = warpgroup_mma(v, do_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        _ws_pass(turn, wg)
        # the statistics travel one tile ahead: their loads run under a tile's products instead of before them
        lse_next, delta_next = _bwd_stats(lse_ptr, delta_ptr, 1, n_txt, nt, ni, t_start, i_stat0, h, n_heads, BLOCK_M,
                                          stat_l)
        s, dp = warpgroup_mma_wait(0, deps=(s, dp))
        p, ds = _bwd_ds(s, dp, lse, delta, qk_scale, op_l)
        for c in range(1, n_all):
            prev = (c - 1) % STAGES
            slot = c % STAGES
            lse = lse_next
            delta = delta_next
            lse_next, delta_next = _bwd_stats(lse_ptr, delta_ptr, c + 1, n_txt, nt, ni, t_start, i_stat0, h, n_heads,
                                              BLOCK_M, stat_l)
            mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
            _ws_turn(turn, wg, c)
            dv = warpgroup_mma(p, do_bufs.index(prev), dv, is_async=True)
            dk = warpgroup_mma(ds, q_bufs.index(prev), dk, is_async=True)
            s = warpgroup_mma(k, q_bufs.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dp = warpgroup_mma(v, do_bufs.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            _ws_pass(turn, wg)
            dv, dk, s, dp = warpgroup_mma_wait(0, deps=(dv, dk, s, dp))
            mbarrier.arrive(empty.index(prev), count=1)
            p, ds = _bwd_ds(s, dp, lse, delta, qk_scale, op_l)
        last = (n_all - 1) % STAGES
        _ws_turn(turn, wg, n_all)
        dv = warpgroup_mma(p, do_bufs.index(last), dv, is_async=True)
        dk = warpgroup_mma(ds, q_bufs.index(last), dk, is_async=True)
        _ws_pass(turn, wg)
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        mbarrier.arrive(empty.index(last), count=1)

        rows = row0 + wg * _HALF + gl.arange(0, _HALF, layout=gl.SliceLayout(1, mma_d))
        cols = col + gl.arange(0, D, layout=gl.SliceLayout(0, mma_d))
        offs = gl.expand_dims(rows.to(gl.int64) * row_stride, 1) + gl.expand_dims(cols, 0)
        ok, _ = gl.broadcast(gl.expand_dims(rows < seg_end, 1), offs)  # the row mask over every column
        dk_out = (dk * sm_scale).to(dk_txt_ptr.dtype.element_ty)
        dv_out = dv.to(dv_txt_ptr.dtype.element_ty)
        if stream == 0:
            gl.store(dk_txt_ptr + offs, dk_out, mask=ok)
            gl.store(dv_txt_ptr + offs, dv_out, mask=ok)
        else:
            gl.store(dk_img_ptr + offs, dk_out, mask=ok)
            gl.store(dv_img_ptr + offs, dv_out, mask=ok)

    @gluon.jit
    def _attn_bwd_dkdv_ws_kernel(
        q_txt_ptr, k_txt_ptr, v_txt_ptr, q_img_ptr, k_img_ptr, v_img_ptr, do_txt_ptr, do_img_ptr,
        dk_txt_ptr, dv_txt_ptr, dk_img_ptr, dv_img_ptr, lse_ptr, delta_ptr, tiles_ptr,
        row_stride, n_heads, qk_scale, sm_scale,
        D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
    ):
        """One (key tile of 128 rows, head); grid (key tiles, heads); 4 warps + 4 + 1 worker warps."""
        h = gl.program_id(1)
        stream, row0, seg_end, _, t_start, nt, i_start, ni, i_stat0 = _ws_tile_row(tiles_ptr)
        col = h * D
        seg0 = gl.where(stream == 0, t_start, i_start)

        smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, _HALF, D], smem)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [2, _HALF, D], smem)
        q_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, D], smem)
        do_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, D], smem)
        kv_bar, ready, empty, turn = _ws_barriers(STAGES)

        k_desc = _ws_desc(gl.where(stream == 0, k_txt_ptr, k_img_ptr), seg0, seg_end - seg0, row_stride, col, _HALF, D)
        v_desc = _ws_desc(gl.where(stream == 0, v_txt_ptr, v_img_ptr), seg0, seg_end - seg0, row_stride, col, _HALF, D)
        qt_desc = _ws_desc(q_txt_ptr, t_start, nt, row_stride, col, BLOCK_M, D)
        dot_desc = _ws_desc(do_txt_ptr, t_start, nt, row_stride, col, BLOCK_M, D)
        qi_desc = _ws_desc(q_img_ptr, i_start, ni, row_stride, col, BLOCK_M, D)
        doi_desc = _ws_desc(do_img_ptr, i_start, ni, row_stride, col, BLOCK_M, D)

        gl.warp_specialize([
            (_bwd_consumer, (gl.constexpr(0), k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty, turn,
                             dk_txt_ptr, dv_txt_ptr, dk_img_ptr, dv_img_ptr, lse_ptr, delta_ptr, stream, row0, seg_end,
                             t_start, nt, ni, i_stat0, col, h, row_stride, n_heads, qk_scale, sm_scale,
                             D, BLOCK_M, STAGES)),
            (_bwd_consumer, (gl.constexpr(1), k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty, turn,
                             dk_txt_ptr, dv_txt_ptr, dk_img_ptr, dv_img_ptr, lse_ptr, delta_ptr, stream, row0, seg_end,
                             t_start, nt, ni, i_stat0, col, h, row_stride, n_heads, qk_scale, sm_scale,
                             D, BLOCK_M, STAGES)),
            (_bwd_loader, (k_desc, v_desc, qt_desc, dot_desc, qi_desc, doi_desc, k_smem, v_smem, q_bufs, do_bufs,
                           kv_bar, ready, empty, row0 - seg0, nt, ni, BLOCK_M, STAGES)),
        ], [4, 1], _REGS)


def launch(q_txt, k_txt, v_txt, q_img, k_img, v_img, do_txt, do_img, dk_txt, dv_txt, dk_img, dv_img, lse, delta,
           table, n_tiles: int, heads: int, d: int, qk_scale: float, sm_scale: float, block_m: int,
           stages: int) -> None:
    """Run the warp-specialized dK/dV kernel over ``table``'s 128-row key tiles (grid ``(n_tiles, heads)``).

    The caller (``attention.attention_bwd``) has validated the inputs, built the tile table, computed Δ and set
    Triton's allocator (device-side descriptors need global scratch); see there for the shapes.
    """
    if gluon is None:
        raise RuntimeError("the warp-specialized dK/dV kernel needs Triton's Gluon front end (triton.experimental.gluon)")
    _attn_bwd_dkdv_ws_kernel[(n_tiles, heads)](
        q_txt, k_txt, v_txt, q_img, k_img, v_img, do_txt, do_img, dk_txt, dv_txt, dk_img, dv_img, lse, delta, table,
        heads * d, heads, qk_scale, sm_scale,
        D=d, BLOCK_M=block_m, STAGES=stages,
        num_warps=4, maxnreg=MAXNREG, enable_fp_fusion=False)

"""Triton kernels of the strict GEMM engine (launched by :mod:`.launch`).

Five kernels: the main product ``_gemm_fwd_kernel`` (forward and dX), the weight gradient
``_gemm_dw_kernel``, the bias gradient ``_gemm_db_kernel`` and two elementwise passes
(``_act_fwd_kernel``: the prologue on its own; ``_act_bwd_kernel``: dZ = dY · act'(Z)).

Arguments are grouped. Host tensor descriptors stay top-level arguments (Triton's launcher encodes
only top-level descriptors); everything else that travels together is one tuple, and every
compile-time choice is one ``tl.constexpr`` named tuple (:class:`FwdSpec`, :class:`DwSpec`), so the
helpers below take the groups as they are instead of re-listing their fields:

* ``strides = (stride_am, stride_bk, stride_bn, stride_om)``: row strides of the input ``a``, the
  weight operand ``b`` read as ``(K, N)`` and the output;
* ``lora = (u_ptr, stride_um, l_ptr, stride_lr, stride_ln, R, scale)``: the LoRA intermediate
  ``u (M, R)``, ``B`` read as ``(R, N)`` and the scale (dummies when ``HAS_LORA`` is off);
* ``epi = (bias_ptr, aux_ptr, stride_auxm, out_ptr, pre_ptr)``: what the epilogue reads and writes;
* ``gate = (gate_ptr, stride_gate, sample_ptr)`` with the ``GATE_RESIDUAL`` epilogue (the per-sample gate
  ``(B, N)`` and each row's sample index, int32), else None (no parameter, no code).

Activation codes are the names of :mod:`.codes`; the FP32 math is :mod:`.fpmath`.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from .codes import ACT_GATE_RESIDUAL, ACT_GELU_TANH, ACT_SILU, ACT_TIMES_SILU_GRAD
from .fpmath import _act_f32, _act_grad_f32


class FwdSpec(NamedTuple):
    """Compile-time choices of one ``_gemm_fwd_kernel`` launch (passed as one ``tl.constexpr``)."""

    PROLOGUE: int  # codes.Act applied to the loaded a tile before the dot (NONE or SILU)
    EPILOGUE: int  # codes.Act applied to the FP32 accumulator before the cast
    HAS_BIAS: bool
    HAS_LORA: bool
    STORE_PRE: bool  # also store the pre-activation (one cast)
    EVEN_K: bool  # K % BLOCK_K == 0: no K mask on pointer loads
    DOT_PRECISION: str  # "ieee": FP32 dots as true FMA chains (BF16 runs on the tensor cores regardless)
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    BLOCK_R: int  # LoRA rank step
    GROUP_M: int  # grouped tile order (L2 reuse; moves no arithmetic)
    USE_TMA: bool  # a/b are host tensor descriptors
    W_NK: bool  # with USE_TMA: b is a descriptor over W (N, K) as stored; boxes transposed before the dot
    TMA_STORE: bool  # the output leaves through out_desc
    EPI_SPLIT: int  # the epilogue on 1, 2 or 4 column parts
    NUM_PROGRAMS: int  # > 0: persistent launch of that many programs


class DwSpec(NamedTuple):
    """Compile-time choices of one ``_gemm_dw_kernel`` launch (passed as one ``tl.constexpr``)."""

    PROLOGUE: int
    HAS_INIT: bool  # continue a fold from an FP32 buffer
    DOT_PRECISION: str
    BLOCK_N: int
    BLOCK_K: int
    BLOCK_M: int  # rows per chunk of a sample's own reduction
    GROUP_N: int


@triton.jit
def _grouped_tile(tile, num_a, num_b, GROUP: tl.constexpr):
    """Tile ``tile`` of a (num_a, num_b) grid in grouped order (GROUP rows of a per column sweep, for
    L2 reuse). Moves no arithmetic: it only decides which program computes which tile."""
    group_size = GROUP * num_b
    first = (tile // group_size) * GROUP
    in_group = tl.minimum(num_a - first, GROUP)
    return first + (tile % group_size) % in_group, (tile % group_size) // in_group


@triton.jit
def _fwd_tile_acc(a_ptr, b_ptr, strides, epi, pid_m, pid_n, M, N, K, CFG: tl.constexpr):
    """FP32 tile ``p(a) @ b (+ bias)`` of output tile (pid_m, pid_n); the LoRA term joins per epilogue part."""
    stride_am, stride_bk, stride_bn, _ = strides
    BLOCK_M: tl.constexpr = CFG.BLOCK_M
    BLOCK_N: tl.constexpr = CFG.BLOCK_N
    BLOCK_K: tl.constexpr = CFG.BLOCK_K
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    if not CFG.USE_TMA:
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + offs_k[:, None].to(tl.int64) * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(tl.cdiv(K, BLOCK_K)):
        if CFG.USE_TMA:
            a = a_ptr.load([pid_m * BLOCK_M, k0 * BLOCK_K])
            if CFG.W_NK:  # a (BLOCK_N, BLOCK_K) box of W as stored, transposed in shared memory
                b = tl.trans(b_ptr.load([pid_n * BLOCK_N, k0 * BLOCK_K]))
            else:
                b = b_ptr.load([k0 * BLOCK_K, pid_n * BLOCK_N])
        elif CFG.EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            k_left = K - k0 * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if CFG.PROLOGUE == ACT_SILU:
            a = _act_f32(a.to(tl.float32), ACT_SILU).to(a_ptr.dtype.element_ty)
        acc = tl.dot(a, b, acc, input_precision=CFG.DOT_PRECISION)
        if not CFG.USE_TMA:
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bk

    if CFG.HAS_BIAS:
        bias = tl.load(epi[0] + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    return acc


@triton.jit
def _fwd_store_part(acc, m0, n0, M, N, lora, epi, gate, out_desc, stride_om, CFG: tl.constexpr, PART_N: tl.constexpr):
    """Epilogue of one (BLOCK_M, PART_N) column part of a tile at (m0, n0): [+ lora_scale · u @ l over the part's
    columns, its own FP32 accumulator over R in BLOCK_R steps], [pre store], activation, one cast, store. Each
    element's LoRA chain runs over R alone, so how a tile is cut into parts moves no arithmetic."""
    _, aux_ptr, stride_auxm, out_ptr, pre_ptr = epi
    offs_m = m0 + tl.arange(0, CFG.BLOCK_M)
    offs_n = n0 + tl.arange(0, PART_N)
    rows = offs_m.to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    out_mask = mask_m[:, None] & mask_n[None, :]
    if CFG.HAS_LORA:  # its own FP32 accumulator per part: a whole-tile one spills the big tiles (benchmarks/lora_regs_sass.py)
        u_ptr, stride_um, l_ptr, stride_lr, stride_ln, R, lora_scale = lora
        BLOCK_R: tl.constexpr = CFG.BLOCK_R
        offs_r = tl.arange(0, BLOCK_R)
        BLOCK_M: tl.constexpr = CFG.BLOCK_M  # tl.zeros takes a constexpr shape, not a field of CFG
        lacc = tl.zeros((BLOCK_M, PART_N), dtype=tl.float32)
        for r0 in range(tl.cdiv(R, BLOCK_R)):
            r_left = R - r0 * BLOCK_R
            u = tl.load(u_ptr + rows[:, None] * stride_um + (r0 * BLOCK_R + offs_r)[None, :],
                        mask=mask_m[:, None] & (offs_r[None, :] < r_left), other=0.0)
            lw = tl.load(l_ptr + (r0 * BLOCK_R + offs_r)[:, None] * stride_lr
                         + offs_n[None, :].to(tl.int64) * stride_ln,
                         mask=(offs_r[:, None] < r_left) & mask_n[None, :], other=0.0)
            lacc = tl.dot(u, lw, lacc, input_precision=CFG.DOT_PRECISION)
        acc = acc + lacc * lora_scale
    out_offs = rows[:, None] * stride_om + offs_n[None, :]
    if CFG.STORE_PRE:
        tl.store(pre_ptr + out_offs, acc.to(pre_ptr.dtype.element_ty), mask=out_mask)
    if CFG.EPILOGUE == ACT_GELU_TANH:
        acc = _act_f32(acc, ACT_GELU_TANH)
    elif CFG.EPILOGUE == ACT_SILU:
        acc = _act_f32(acc, ACT_SILU)
    elif CFG.EPILOGUE == ACT_TIMES_SILU_GRAD:
        xa = tl.load(aux_ptr + rows[:, None] * stride_auxm + offs_n[None, :], mask=out_mask, other=0.0)
        acc = acc * _act_grad_f32(xa.to(tl.float32), ACT_SILU)
    elif CFG.EPILOGUE == ACT_GATE_RESIDUAL:  # the gated residual's own operations on the product's rounded output
        gate_ptr, stride_gate, sample_ptr = gate
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        sample = tl.load(sample_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        g = tl.load(gate_ptr + sample[:, None] * stride_gate + offs_n[None, :], mask=out_mask, other=0.0)
        xa = tl.load(aux_ptr + rows[:, None] * stride_auxm + offs_n[None, :], mask=out_mask, other=0.0)
        acc = xa.to(tl.float32) + g.to(tl.float32) * y
    if CFG.TMA_STORE:
        out_desc.store([m0, n0], acc.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _halves(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Column halves ``x[:, :COLS//2], x[:, COLS//2:]`` of a (ROWS, COLS) tile (no arithmetic)."""
    return tl.split(tl.permute(tl.reshape(x, (ROWS, 2, COLS // 2)), (0, 2, 1)))


@triton.jit
def _fwd_tile_store(acc, pid_m, pid_n, M, N, lora, epi, gate, out_desc, stride_om, CFG: tl.constexpr):
    """Epilogue of a whole tile in EPI_SPLIT column parts (1, 2 or 4): fewer live registers per part."""
    BLOCK_M: tl.constexpr = CFG.BLOCK_M
    BLOCK_N: tl.constexpr = CFG.BLOCK_N
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    if CFG.EPI_SPLIT == 1:
        _fwd_store_part(acc, m0, n0, M, N, lora, epi, gate, out_desc, stride_om, CFG, BLOCK_N)
    elif CFG.EPI_SPLIT == 2:
        HALF: tl.constexpr = BLOCK_N // 2
        h0, h1 = _halves(acc, BLOCK_M, BLOCK_N)
        _fwd_store_part(h0, m0, n0, M, N, lora, epi, gate, out_desc, stride_om, CFG, HALF)
        _fwd_store_part(h1, m0, n0 + HALF, M, N, lora, epi, gate, out_desc, stride_om, CFG, HALF)
    else:
        PART: tl.constexpr = BLOCK_N // 4
        h0, h1 = _halves(acc, BLOCK_M, BLOCK_N)
        q0, q1 = _halves(h0, BLOCK_M, BLOCK_N // 2)
        q2, q3 = _halves(h1, BLOCK_M, BLOCK_N // 2)
        _fwd_store_part(q0, m0, n0, M, N, lora, epi, gate, out_desc, stride_om, CFG, PART)
        _fwd_store_part(q1, m0, n0 + PART, M, N, lora, epi, gate, out_desc, stride_om, CFG, PART)
        _fwd_store_part(q2, m0, n0 + 2 * PART, M, N, lora, epi, gate, out_desc, stride_om, CFG, PART)
        _fwd_store_part(q3, m0, n0 + 3 * PART, M, N, lora, epi, gate, out_desc, stride_om, CFG, PART)


@triton.jit(do_not_specialize=["M"])
def _gemm_fwd_kernel(a_ptr, b_ptr, out_desc, strides, lora, epi, M, N, K, gate, CFG: tl.constexpr):
    """out(M, N) = epi(p(a)(M, K) @ b(K, N) + bias + lora_scale · u(M, R) @ l(R, N)).

    Reduction: acc = 0; for k0 = 0, BLOCK_K, 2·BLOCK_K, … < K: acc = dot(p(a)[:, k0:k0+BK], b[k0:k0+BK], acc)
    (one program owns a (BLOCK_M, BLOCK_N) output tile and its whole K range). FP32 (ieee) dots are
    one FMA chain over all of K per element. (``acc + dot(a, b)`` with a fresh accumulator is folded
    back into ``dot(a, b, acc)`` by Triton's combiner — measured on the H200: identical bytes — so a
    two-level FP32 sum needs another formulation; see experiments/gemm/NOTES.md.) LoRA: a second FP32
    accumulator over R in BLOCK_R steps, same form, one per epilogue column part. Then, in FP32: acc = acc + bias;
    acc = acc + lora_scale · lacc; [pre = acc, stored with one cast]; out = epi(acc) stored with one cast.
    PROLOGUE ACT_SILU: p = silu, in FP32 on the loaded a tile, rounded once to a's dtype before the dot.
    EPILOGUE: ACT_NONE, ACT_GELU_TANH, ACT_SILU, or ACT_TIMES_SILU_GRAD (multiply by silu'(aux), the
    prologue's backward), or ACT_GATE_RESIDUAL (out = aux + gate[s]·y with y the accumulator rounded once
    to the output dtype and s the row's sample: the gated residual's arithmetic on the product's own bytes,
    no y stored). Masked rows/columns load 0 and are never stored; the grouped tile order
    moves no arithmetic. M is not specialized (``do_not_specialize``): one compiled kernel serves every M.
    USE_TMA (Hopper, ``configs`` per shape class): ``a_ptr``/``b_ptr`` are host tensor descriptors
    and the tiles arrive by the bulk tensor copy engine (out-of-range elements read as 0, exactly
    what the masked loads give); the dot sequence, hence the arithmetic, is the same. W_NK: ``b_ptr``
    describes nn.Linear's W (N, K) as stored; each (BLOCK_N, BLOCK_K) box is transposed (in shared
    memory) into the same (BLOCK_K, BLOCK_N) operand a prepacked Wᵀ would give — same values, same
    dot, same bytes, no second copy of the weight. TMA_STORE: the output leaves through
    ``out_desc`` (rows past M are clipped by the copy engine). EPI_SPLIT: the epilogue runs on 1, 2
    or 4 column parts of the tile (elementwise: same bytes). NUM_PROGRAMS > 0: persistent — that
    many programs walk the tiles (tile t, t + NUM_PROGRAMS, …) in one flattened loop, so the copy
    engine fetches the next tile's operands during this tile's epilogue; every tile is computed
    exactly as by its own program.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, CFG.BLOCK_M)
    num_pid_n = tl.cdiv(N, CFG.BLOCK_N)
    stride_om = strides[3]
    if CFG.NUM_PROGRAMS > 0:
        tile_c = pid - CFG.NUM_PROGRAMS  # separate counter for the epilogue, as the pipeliner prefers
        for tile in tl.range(pid, num_pid_m * num_pid_n, CFG.NUM_PROGRAMS, flatten=True):
            pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, CFG.GROUP_M)
            acc = _fwd_tile_acc(a_ptr, b_ptr, strides, epi, pid_m, pid_n, M, N, K, CFG)
            tile_c += CFG.NUM_PROGRAMS
            pid_m_c, pid_n_c = _grouped_tile(tile_c, num_pid_m, num_pid_n, CFG.GROUP_M)
            _fwd_tile_store(acc, pid_m_c, pid_n_c, M, N, lora, epi, gate, out_desc, stride_om, CFG)
    else:
        pid_m, pid_n = _grouped_tile(pid, num_pid_m, num_pid_n, CFG.GROUP_M)
        acc = _fwd_tile_acc(a_ptr, b_ptr, strides, epi, pid_m, pid_n, M, N, K, CFG)
        _fwd_tile_store(acc, pid_m, pid_n, M, N, lora, epi, gate, out_desc, stride_om, CFG)


@triton.jit(do_not_specialize=["S"])
def _gemm_dw_kernel(g_ptr, x_ptr, starts_ptr, init_ptr, out_ptr, N, K, S, stride_gm, stride_xm, scale,
                    CFG: tl.constexpr):
    """out(N, K) = fold_s [ scale · Σ_{rows of sample s} g[rows]ᵀ p(x)[rows] ].

    Per sample s (rows starts[s] .. starts[s+1]): part = 0; for m0 = starts[s], +BLOCK_M, … :
    part = dot(g[m0:m0+BM]ᵀ, p(x)[m0:m0+BM], part) — the chunking starts at the sample's own first
    row, so the tree depends only on its row count. Fold: acc = init (or 0); for s = 0..S−1:
    acc = acc + scale·part (two IEEE FP32 operations; scale = 1 is exact). One cast at the store.
    ``init`` lets a caller continue a fold across micro-batches in an FP32 buffer.
    """
    BLOCK_N: tl.constexpr = CFG.BLOCK_N
    BLOCK_K: tl.constexpr = CFG.BLOCK_K
    pid_n, pid_k = _grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(K, BLOCK_K), CFG.GROUP_N)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, CFG.BLOCK_M)
    mask_n = offs_n < N
    mask_k = offs_k < K
    out_mask = mask_n[:, None] & mask_k[None, :]
    out_offs = offs_n[:, None].to(tl.int64) * K + offs_k[None, :]

    if CFG.HAS_INIT:
        acc = tl.load(init_ptr + out_offs, mask=out_mask, other=0.0)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for s in range(S):
        start = tl.load(starts_ptr + s)
        end = tl.load(starts_ptr + s + 1)
        part = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for m0 in range(start, end, CFG.BLOCK_M):
            rows = m0 + offs_m
            mask_m = rows < end
            rows64 = rows.to(tl.int64)
            g = tl.load(g_ptr + rows64[:, None] * stride_gm + offs_n[None, :],
                        mask=mask_m[:, None] & mask_n[None, :], other=0.0)
            x = tl.load(x_ptr + rows64[:, None] * stride_xm + offs_k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            if CFG.PROLOGUE == ACT_SILU:
                x = _act_f32(x.to(tl.float32), ACT_SILU).to(x_ptr.dtype.element_ty)
            part = tl.dot(tl.trans(g), x, part, input_precision=CFG.DOT_PRECISION)
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
    for s in range(S):
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

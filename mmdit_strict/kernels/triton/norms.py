"""CUDA strict modulation operators (Triton): AdaLN modulation, gated residual, final AdaLN, text-input norm.

Operators (signatures of docs/operators.md):

* ``adaln_modulation(x (M, D), shift (B, D), scale (B, D), *, seqlens, eps)`` →
  ``LayerNorm(x)·(1 + scale[s]) + shift[s]`` (parameter-free LayerNorm, biased variance);
* ``adaln_gate_residual(x (M, D), y (M, D), gate (B, D), *, seqlens)`` → ``x + gate[s]·y``;
* ``final_adaln_out(x, temb (B, D), weight (2D, D), bias (2D,), *, seqlens, eps, lora)``:
  ``scale, shift = SiLU(temb) Wᵀ + b`` on the strict GEMM engine (one row per sample), then
  :func:`adaln_modulation` with that (scale, shift);
* ``txt_in_rmsnorm_linear(x (M, Ct), gain (Ct,), weight (N, Ct), bias, *, seqlens, eps, lora)``:
  the RMSNorm of :mod:`.rope` (one head of width Ct) writes the normalized rows once, then the GEMM engine.

Arithmetic (FP32 inside, every operation one IEEE rounding in the order written: kernels compile with
``enable_fp_fusion=False``; divisions are ``div_rn`` and square roots ``sqrt_rn``, both correctly rounded):

* LayerNorm of a row: ``mean = Σx ⊘ D``; ``xc = x − mean``; ``var = Σxc² ⊘ D``;
  ``rstd = 1 ⊘ √(var + eps)``; ``x̂ = xc·rstd``; ``y = x̂·(1 + scale) + shift``. Each Σ is one ``tl.sum``
  over the row (a fixed tree for the compiled kernel; the configuration depends on D only). Where D is three
  times a power of two (Qwen-Image's 3072, :func:`ln_thirds`) the forward holds the row as three such tiles
  and each Σ first adds the thirds lane by lane, ``(t0 + t1) + t2``, then ``tl.sum``s that one tile.
  One cast to the storage dtype at ``y``. ``mean`` and ``rstd`` (FP32, per row) are saved for backward.
* LayerNorm-modulation backward: ``g = dy·(1 + scale)``, ``dx = ((g − Σg ⊘ D) − x̂·(Σg·x̂ ⊘ D))·rstd``;
  ``d_scale[s] = Σ_rows dy·x̂`` and ``d_shift[s] = Σ_rows dy`` on the per-sample tree of :mod:`.segments`.
  Where the forward holds thirds so does the backward: its two row sums take the thirds tree. Those vectors are
  column sums (each column chained down the rows), so their bytes do not depend on the tile.
* Gated residual: ``out = x + gate·y``; backward ``dx = dout`` (the same tensor), ``dy = dout·gate``,
  ``d_gate[s] = Σ_rows dout·y`` (per-sample tree). No sum crosses columns there, so the backward splits a chunk's
  columns over programs of ``GATE_BWD_COLS`` lanes (3072 = three full tiles, no masked lane) with the bytes of one
  program per chunk.

A row's forward bytes depend only on the row and its sample's vectors; the per-sample sums depend only on
that sample's rows. How the LayerNorm kernels are launched (rows per forward program, read-ahead, register
cap: :class:`LnLaunch`) changes no byte. Per-sample vectors are read through their row stride (views such as the halves of
the final modulation need no copy); rows must be contiguous.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from ..choice import KernelSetting
from ..registry import KernelImpl, register
from . import segments as seg
from .gemm import _DTYPES, _interpreting, check_dtype_device, gemm, launch_opts
from .rope import check_gain, check_stages, num_warps_for, rms_norm_rows, stages_label
from .segments import check_seqlens

FWD_ROWS = 4  # rows per gated-residual forward program (row-local math: no effect on bytes)
# Columns per gated-residual backward program (a power of two). The backward has no sum across columns, so a chunk's
# columns split over programs give the same bytes as one program per chunk (tested): 3072 columns are three programs
# of 1024 lanes and 4 warps each, 768 programs at 4096 rows instead of 256.
GATE_BWD_COLS = 1024
MAX_WIDTH = 16384


@dataclass(frozen=True)
class LnLaunch:
    """How the LayerNorm kernels of adaln_modulation / final_adaln_out are launched. None of it touches the
    arithmetic: the same formulas, the same tiles (from D only: pow2(D) lanes, or three D/3-lane thirds, see
    :func:`ln_thirds`; warps from the tile), hence the same register layout and tree for every tl.sum (GPU test
    ``test_gpu_ln_launch_bytes_equal_reference``); none of it is chosen from the number of rows.

    fwd_rows: rows per forward program (the forward has no cross-row sum: any grouping gives the same bytes);
    fwd_ahead / bwd_ahead: 1 = the kernel reads row r+1 while it reduces row r (a register double buffer), 0 = not;
    fwd_maxnreg / bwd_maxnreg: a register cap for ptxas (more programs resident per SM; may spill), None = none;
    fwd_stages / bwd_stages: None, or 2..8 = the row loop software-pipelined by Triton (``tl.range(num_stages=)``):
    the next rows' loads go through shared memory (cp.async) instead of registers, into the same register layout
    (offline sm_90 compile: the same tt.reduce operand layouts); with stages, ahead is 0.
    The backward's chunks stay segments.CHUNK_ROWS rows (they are the d_scale / d_shift tree)."""

    fwd_rows: int = 4
    fwd_ahead: int = 1
    fwd_maxnreg: int | None = None
    bwd_ahead: int = 1
    bwd_maxnreg: int | None = None
    fwd_stages: int | None = None
    bwd_stages: int | None = None

    def label(self) -> str:
        return (f"fwd rows {self.fwd_rows}, ahead {self.fwd_ahead}, maxnreg {self.fwd_maxnreg or '-'}{stages_label(self.fwd_stages)}; "
                f"bwd ahead {self.bwd_ahead}, maxnreg {self.bwd_maxnreg or '-'}{stages_label(self.bwd_stages)}")


# The kernels as the H200 measured them at 6ab3b56 (4-row forward programs, no read-ahead): the reference
# the GPU tests and the bench compare every launch with, byte for byte.
LN_REFERENCE = LnLaunch(fwd_rows=4, fwd_ahead=0)
# The defaults, per execution dtype (not per row count), picked from the H200 sweep at c893898
# (experiments/norms/c893898: every candidate byte-equal to the reference). Forward, both dtypes: 4-row
# programs, one row read ahead, at most 80 registers (three programs per SM): 4096 / 6889 rows
# 0.0240 -> 0.0197 / 0.0387 -> 0.0314 ms bf16, fp32 0.0335 -> 0.0294. Backward: bf16 one row ahead capped
# at 128 registers (two programs per SM, 16 B spilled): 0.0415 -> 0.032 / 0.0764 -> 0.0585 ms; fp32 no
# read-ahead (123 registers, two per SM without a cap; the capped read-ahead spills 80 B): 0.0586 -> 0.0525.
# fp32 backward since the H200 tune run at 801d99e (experiments/norms/801d99e, every candidate byte-equal to the
# reference): the row loop pipelined in 3 stages through shared memory, 0.0525 -> 0.0497 ms (0.71 -> 0.75 of
# copy); bf16 gained 1 % there (0.0321 -> 0.0317, within run noise) and keeps its launch.
# Forward since the row of 3072 is held as three 1024-lane thirds (ln_thirds; new forward bytes): one row per
# program, no read-ahead, no register cap, 4 warps (benchmarks/ln_chunks_probe at c8b4c70+probe,
# experiments/norms/c8b4c70_ln_thirds: bf16 4096 / 6889 rows 0.0199 -> 0.0144 / 0.0320 -> 0.0240 ms, 0.63 -> 0.87 /
# 0.72 -> 0.95 of the copy; fp32 0.0296 -> 0.0268, 0.86 -> 0.95); the earlier 80-register cap spills with thirds.
# Integrated as such at 75b7b41 the product ran 0.0193 ms (no gain: experiments/norms/75b7b41_thirds); this launch now
# takes _adaln_mod_fwd_thirds_row (the row from the program id; offline sm_90: 53 registers bf16, no loop). H200 at
# da978ed (experiments/norms/da978ed_thirds_direct): bf16 4096 / 6889 rows 0.0144 / 0.0241 ms (0.85 / 0.95 of the copy),
# fp32 0.0273 (0.93).
# Backward since it holds thirds too (6de295f, new dx bytes): fp32 reads one row ahead, capped at 128 registers, as bf16
# (H200 tune at 6de295f, experiments/norms/6de295f, 96/96 candidates byte-equal: fp32 4096 rows 0.0494 -> 0.0482 ms,
# 0.75 -> 0.77 of the copy; bf16 0.0303 ms, 0.64, where the one-tile backward ran 0.0321, 0.61).
LN_DEFAULTS = {
    torch.bfloat16: LnLaunch(fwd_rows=1, fwd_ahead=0, bwd_ahead=1, bwd_maxnreg=128),
    torch.float32: LnLaunch(fwd_rows=1, fwd_ahead=0, bwd_ahead=1, bwd_maxnreg=128),
}
# What the bench's "tune" section and the GPU byte test run: the reference, the defaults and these (the
# list the H200 swept at c893898, plus the bf16 default, whose forward and backward settings it measured
# in separate candidates).
LN_CANDIDATES = tuple(dict.fromkeys([
    LN_REFERENCE, *LN_DEFAULTS.values(), LnLaunch(fwd_rows=1, fwd_ahead=0, bwd_ahead=0, bwd_stages=3),  # fp32 until 6de295f
    LnLaunch(fwd_rows=4, fwd_ahead=1, fwd_maxnreg=80, bwd_ahead=0),
    *(LnLaunch(fwd_rows=r, fwd_ahead=a, fwd_maxnreg=m, bwd_ahead=ba, bwd_maxnreg=bm)
      for r, a, m, ba, bm in ((4, 1, None, 1, None), (1, 0, None, 0, None), (1, 1, None, 1, 128), (8, 1, None, 0, None),
                              (2, 1, 80, 0, None), (1, 0, 64, 0, None), (8, 0, 64, 1, 128))),
    # the row loops pipelined through shared memory (timed on the H200 at 801d99e: experiments/norms/801d99e)
    *(LnLaunch(fwd_rows=r, fwd_ahead=0, fwd_maxnreg=m, fwd_stages=fs, bwd_ahead=0, bwd_maxnreg=bm, bwd_stages=bs)
      for r, m, fs, bm, bs in ((4, 80, 2, None, 2), (8, 80, 3, None, 3), (8, None, 3, 128, 4), (16, 80, 4, None, 4),
                               (16, None, 6, None, 6))),
]))


def _check_ln_launch(launch: object) -> None:
    if not isinstance(launch, LnLaunch) or launch.fwd_rows < 1 or {launch.fwd_ahead, launch.bwd_ahead} - {0, 1}:
        raise ValueError(f"expected an LnLaunch with fwd_rows >= 1 and fwd_ahead / bwd_ahead 0 or 1, got {launch!r}")
    check_stages(launch.fwd_stages, launch.fwd_ahead, "LnLaunch forward")
    check_stages(launch.bwd_stages, launch.bwd_ahead, "LnLaunch backward")


_LN_LAUNCH: KernelSetting[LnLaunch | None] = KernelSetting("ln launch", None, _check_ln_launch)


def current_ln_launch(dtype: torch.dtype) -> LnLaunch:
    """The LayerNorm launch settings in force for ``dtype`` (the innermost :func:`ln_launch`, else
    :data:`LN_DEFAULTS`)."""
    return _LN_LAUNCH.get() or LN_DEFAULTS[dtype]


def ln_launch(launch: LnLaunch) -> contextlib.AbstractContextManager[None]:
    """Launch the LayerNorm kernels with ``launch`` inside the block, whatever the dtype (bench and tests).
    Context-local; the autograd node keeps the launch in force at its forward for its backward, which
    autograd may run on another thread."""
    return _LN_LAUNCH.use(launch)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _layer_norm_row(x, mask, d_float, eps):
    """(mean, rstd, x̂) of one FP32 row (masked lanes of x are 0): Σ by tl.sum, ⊘ and √ correctly rounded."""
    mean = tl.div_rn(tl.sum(x, axis=0), d_float)
    xc = tl.where(mask, x - mean, 0.0)
    var = tl.div_rn(tl.sum(xc * xc, axis=0), d_float)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    return mean, rstd, xc * rstd


@triton.jit
def _layer_norm_thirds(x0, x1, x2, d_float, eps):
    """(mean, rstd, x̂ of each third) of one FP32 row held as three full tiles (no masked lane). Each Σ adds
    the thirds lane by lane, ``(t0 + t1) + t2``, then reduces that one tile with tl.sum."""
    mean = tl.div_rn(tl.sum((x0 + x1) + x2, axis=0), d_float)
    c0, c1, c2 = x0 - mean, x1 - mean, x2 - mean
    var = tl.div_rn(tl.sum((c0 * c0 + c1 * c1) + c2 * c2, axis=0), d_float)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    return mean, rstd, c0 * rstd, c1 * rstd, c2 * rstd


@triton.jit
def _program_chunk(table_ptr, n_chunks):
    """This program's chunk of a :class:`.segments.Chunks` table: (c, first row, end row, sample as int64)."""
    c = tl.program_id(0)
    r0 = tl.load(table_ptr + c)
    r1 = tl.load(table_ptr + n_chunks + c)
    s = tl.load(table_ptr + 2 * n_chunks + c).to(tl.int64)
    return c, r0, r1, s


@triton.jit
def _sample_vector(v_ptr, s, stride_v, cols, mask):
    """Sample s's row of a per-sample (B, D) vector in FP32 (masked lanes 0)."""
    return tl.load(v_ptr + s * stride_v + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_scale_shift_partials(part_ptr, c, stride_part, D, cols, mask, p_scale, p_shift):
    """Chunk c's partial row: part[c, :D] = the scale partials, part[c, D:] = the shift partials."""
    base = part_ptr + c.to(tl.int64) * stride_part
    tl.store(base + cols, p_scale, mask=mask)
    tl.store(base + D + cols, p_shift, mask=mask)


@triton.jit
def _adaln_mod_fwd_kernel(
    x_ptr, shift_ptr, scale_ptr, table_ptr, y_ptr, mean_ptr, rstd_ptr,
    n_chunks, D, d_float, eps, stride_x, stride_y, stride_shift, stride_scale,
    STORE_STATS: tl.constexpr, AHEAD: tl.constexpr, STAGES: tl.constexpr, BLOCK_D: tl.constexpr,
    THIRDS: tl.constexpr = False, ONE_ROW: tl.constexpr = False,
):
    """y = x̂·(1 + scale[s]) + shift[s] for the rows of one chunk (all of sample s); one cast at the store.
    AHEAD: row r+1 is read (in the storage dtype) before row r is reduced; nothing past the chunk is read.
    STAGES (None or 2..8): the row loop pipelined through shared memory. The row's arithmetic is the same
    either way. THIRDS (D = 3·BLOCK_D): the row as three BLOCK_D-lane tiles (:func:`_adaln_mod_fwd_thirds`)."""
    if THIRDS and ONE_ROW:
        _adaln_mod_fwd_thirds_row(x_ptr, shift_ptr, scale_ptr, y_ptr, mean_ptr, rstd_ptr, table_ptr, n_chunks, d_float,
                                  eps, stride_x, stride_y, stride_shift, stride_scale, STORE_STATS, BLOCK_D)
    elif THIRDS:
        _, r0, r1, s = _program_chunk(table_ptr, n_chunks)
        _adaln_mod_fwd_thirds(x_ptr, shift_ptr, scale_ptr, y_ptr, mean_ptr, rstd_ptr, r0, r1, s, d_float, eps,
                              stride_x, stride_y, stride_shift, stride_scale, STORE_STATS, AHEAD, STAGES, BLOCK_D)
    else:
        _, r0, r1, s = _program_chunk(table_ptr, n_chunks)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        first = r0.to(tl.int64)
        if AHEAD:
            x_cur = tl.load(x_ptr + first * stride_x + cols, mask=mask, other=0.0)  # a chunk has >= 1 row
        scale1 = 1.0 + _sample_vector(scale_ptr, s, stride_scale, cols, mask)
        shift = _sample_vector(shift_ptr, s, stride_shift, cols, mask)
        for i in tl.range(0, r1 - r0, num_stages=STAGES):
            row = first + i
            if AHEAD:
                nxt = row + 1
                x_nxt = tl.load(x_ptr + nxt * stride_x + cols, mask=cols < tl.where(nxt < r1, D, 0), other=0.0)
                x = x_cur.to(tl.float32)
            else:
                x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            mean, rstd, xhat = _layer_norm_row(x, mask, d_float, eps)
            y = xhat * scale1 + shift
            tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
            if STORE_STATS:
                tl.store(mean_ptr + row, mean)
                tl.store(rstd_ptr + row, rstd)
            if AHEAD:
                x_cur = x_nxt


@triton.jit
def _load_thirds(ptr, cols, W: tl.constexpr):
    """The three W-lane thirds of one row (storage dtype)."""
    return tl.load(ptr + cols), tl.load(ptr + W + cols), tl.load(ptr + 2 * W + cols)


@triton.jit
def _load_thirds_if(ptr, cols, W: tl.constexpr, ok):
    """:func:`_load_thirds` where ``ok`` (zeros where it is False: the read-ahead past a chunk's last row)."""
    return (tl.load(ptr + cols, mask=ok, other=0.0), tl.load(ptr + W + cols, mask=ok, other=0.0),
            tl.load(ptr + 2 * W + cols, mask=ok, other=0.0))


@triton.jit
def _store_thirds(ptr, cols, W: tl.constexpr, t0, t1, t2):
    """Store three W-lane tiles as one row (the counterpart of :func:`_load_thirds`)."""
    tl.store(ptr + cols, t0)
    tl.store(ptr + W + cols, t1)
    tl.store(ptr + 2 * W + cols, t2)


@triton.jit
def _adaln_mod_fwd_thirds_row(x_ptr, shift_ptr, scale_ptr, y_ptr, mean_ptr, rstd_ptr, table_ptr, n_chunks, d_float, eps,
                              stride_x, stride_y, stride_shift, stride_scale, STORE_STATS: tl.constexpr, W: tl.constexpr):
    """:func:`_adaln_mod_fwd_thirds` for one-row chunks (launch fwd_rows 1, no read-ahead, no stages): chunk c is
    row c (chunks are cut per sample from its first row and samples are packed in order), so the row's loads do
    not wait for the chunk table; only the per-sample vectors wait for the sample index. Same arithmetic."""
    c = tl.program_id(0)
    row = c.to(tl.int64)
    cols = tl.arange(0, W)
    x0, x1, x2 = _load_thirds(x_ptr + row * stride_x, cols, W)
    s = tl.load(table_ptr + 2 * n_chunks + c).to(tl.int64)
    mean, rstd, h0, h1, h2 = _layer_norm_thirds(x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), d_float, eps)
    sc = scale_ptr + s * stride_scale
    sh = shift_ptr + s * stride_shift
    out = y_ptr + row * stride_y
    dt = y_ptr.dtype.element_ty
    _store_thirds(out, cols, W,
                  (h0 * (1.0 + tl.load(sc + cols).to(tl.float32)) + tl.load(sh + cols).to(tl.float32)).to(dt),
                  (h1 * (1.0 + tl.load(sc + W + cols).to(tl.float32)) + tl.load(sh + W + cols).to(tl.float32)).to(dt),
                  (h2 * (1.0 + tl.load(sc + 2 * W + cols).to(tl.float32))
                   + tl.load(sh + 2 * W + cols).to(tl.float32)).to(dt))
    if STORE_STATS:
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)


@triton.jit
def _adaln_mod_fwd_thirds(x_ptr, shift_ptr, scale_ptr, y_ptr, mean_ptr, rstd_ptr, r0, r1, s, d_float, eps,
                          stride_x, stride_y, stride_shift, stride_scale,
                          STORE_STATS: tl.constexpr, AHEAD: tl.constexpr, STAGES: tl.constexpr, W: tl.constexpr):
    """The forward rows r0..r1 of sample s with D = 3·W: each row as three full W-lane tiles, so no lane is masked
    (a 3072-wide row as 3 x 1024 instead of one 4096-lane tile a quarter idle). Tree: :func:`_layer_norm_thirds`."""
    cols = tl.arange(0, W)
    first = r0.to(tl.int64)
    sc = scale_ptr + s * stride_scale
    sh = shift_ptr + s * stride_shift
    a0, a1, a2 = (1.0 + tl.load(sc + cols).to(tl.float32), 1.0 + tl.load(sc + W + cols).to(tl.float32),
                  1.0 + tl.load(sc + 2 * W + cols).to(tl.float32))
    b0, b1, b2 = (tl.load(sh + cols).to(tl.float32), tl.load(sh + W + cols).to(tl.float32),
                  tl.load(sh + 2 * W + cols).to(tl.float32))
    if AHEAD:
        n0, n1, n2 = _load_thirds(x_ptr + first * stride_x, cols, W)  # a chunk has >= 1 row
    for i in tl.range(0, r1 - r0, num_stages=STAGES):
        row = first + i
        if AHEAD:
            x0, x1, x2 = n0, n1, n2
            n0, n1, n2 = _load_thirds_if(x_ptr + (row + 1) * stride_x, cols, W, (cols * 0 + row + 1) < r1)
        else:
            x0, x1, x2 = _load_thirds(x_ptr + row * stride_x, cols, W)
        mean, rstd, h0, h1, h2 = _layer_norm_thirds(x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), d_float, eps)
        out = y_ptr + row * stride_y
        dt = y_ptr.dtype.element_ty
        _store_thirds(out, cols, W, (h0 * a0 + b0).to(dt), (h1 * a1 + b1).to(dt), (h2 * a2 + b2).to(dt))
        if STORE_STATS:
            tl.store(mean_ptr + row, mean)
            tl.store(rstd_ptr + row, rstd)


@triton.jit
def _adaln_mod_bwd_kernel(
    x_ptr, scale_ptr, dy_ptr, mean_ptr, rstd_ptr, table_ptr, dx_ptr, part_ptr,
    n_chunks, D, d_float, stride_x, stride_dy, stride_dx, stride_scale, stride_part,
    NEED_VEC: tl.constexpr, AHEAD: tl.constexpr, STAGES: tl.constexpr, BLOCK_D: tl.constexpr,
    THIRDS: tl.constexpr = False,
):
    """One chunk (≤ CHUNK_ROWS rows of sample s): dx per row, and the chunk's partials
    part[c, :D] = Σ dy·x̂, part[c, D:] = Σ dy chained in row order (FP32). AHEAD: the next row's x, dy,
    mean and rstd are loaded before the current row is reduced (a register double buffer); 0: each row is
    read when it is processed; STAGES (None or 2..8, with AHEAD 0): the row loop pipelined through shared
    memory. No effect on the arithmetic. THIRDS (D = 3·BLOCK_D): :func:`_adaln_mod_bwd_thirds`."""
    c, r0, r1, s = _program_chunk(table_ptr, n_chunks)
    if THIRDS:
        _adaln_mod_bwd_thirds(x_ptr, scale_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr, c, r0, r1, s, D, d_float,
                              stride_x, stride_dy, stride_dx, stride_scale, stride_part, NEED_VEC, AHEAD, STAGES, BLOCK_D)
        return
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    scale1 = 1.0 + _sample_vector(scale_ptr, s, stride_scale, cols, mask)
    p_scale = tl.zeros((BLOCK_D,), dtype=tl.float32)
    p_shift = tl.zeros((BLOCK_D,), dtype=tl.float32)
    first = r0.to(tl.int64)
    if AHEAD:
        x_c = tl.load(x_ptr + first * stride_x + cols, mask=mask, other=0.0)
        dy_c = tl.load(dy_ptr + first * stride_dy + cols, mask=mask, other=0.0)
        mean_c = tl.load(mean_ptr + first)
        rstd_c = tl.load(rstd_ptr + first)
    for i in tl.range(0, r1 - r0, num_stages=STAGES):
        row = first + i
        if AHEAD:
            nxt = row + 1
            nmask = cols < tl.where(nxt < r1, D, 0)  # nothing past the chunk's last row is read
            nclamp = tl.minimum(nxt, r1 - 1)
            x_n = tl.load(x_ptr + nxt * stride_x + cols, mask=nmask, other=0.0)
            dy_n = tl.load(dy_ptr + nxt * stride_dy + cols, mask=nmask, other=0.0)
            mean_n = tl.load(mean_ptr + nclamp)
            rstd_n = tl.load(rstd_ptr + nclamp)
            x, dy, mean, rstd = x_c, dy_c, mean_c, rstd_c
        else:
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
            dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0)
            mean = tl.load(mean_ptr + row)
            rstd = tl.load(rstd_ptr + row)
        xhat = tl.where(mask, x.to(tl.float32) - mean, 0.0) * rstd
        dyf = dy.to(tl.float32)
        g = dyf * scale1
        c1 = tl.div_rn(tl.sum(g * xhat, axis=0), d_float)
        c2 = tl.div_rn(tl.sum(g, axis=0), d_float)
        dx = ((g - c2) - xhat * c1) * rstd
        tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if NEED_VEC:
            p_scale = p_scale + dyf * xhat
            p_shift = p_shift + dyf
        if AHEAD:
            x_c, dy_c, mean_c, rstd_c = x_n, dy_n, mean_n, rstd_n
    if NEED_VEC:
        _store_scale_shift_partials(part_ptr, c, stride_part, D, cols, mask, p_scale, p_shift)


@triton.jit
def _adaln_mod_bwd_thirds(x_ptr, scale_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr, c, r0, r1, s, D, d_float,
                          stride_x, stride_dy, stride_dx, stride_scale, stride_part,
                          NEED_VEC: tl.constexpr, AHEAD: tl.constexpr, STAGES: tl.constexpr, W: tl.constexpr):
    """The backward of chunk c (rows r0..r1 of sample s) with D = 3·W, each row as three full W-lane tiles. The
    row sums Σg·x̂ and Σg add the thirds lane by lane, ``(t0 + t1) + t2``, then tl.sum one tile (the forward's
    tree). The partials are per column, chained in row order as in the one-tile kernel: the same bytes."""
    cols = tl.arange(0, W)
    sc = scale_ptr + s * stride_scale
    a0 = 1.0 + tl.load(sc + cols).to(tl.float32)
    a1 = 1.0 + tl.load(sc + W + cols).to(tl.float32)
    a2 = 1.0 + tl.load(sc + 2 * W + cols).to(tl.float32)
    ps0 = tl.zeros((W,), dtype=tl.float32)
    ps1 = tl.zeros((W,), dtype=tl.float32)
    ps2 = tl.zeros((W,), dtype=tl.float32)
    pb0 = tl.zeros((W,), dtype=tl.float32)
    pb1 = tl.zeros((W,), dtype=tl.float32)
    pb2 = tl.zeros((W,), dtype=tl.float32)
    first = r0.to(tl.int64)
    if AHEAD:  # a chunk has >= 1 row
        xc0, xc1, xc2 = _load_thirds(x_ptr + first * stride_x, cols, W)
        dc0, dc1, dc2 = _load_thirds(dy_ptr + first * stride_dy, cols, W)
        mean_c = tl.load(mean_ptr + first)
        rstd_c = tl.load(rstd_ptr + first)
    for i in tl.range(0, r1 - r0, num_stages=STAGES):
        row = first + i
        if AHEAD:
            nxt = row + 1
            ok = (cols * 0 + nxt) < r1  # nothing past the chunk's last row is read
            nclamp = tl.minimum(nxt, r1 - 1)
            xn0, xn1, xn2 = _load_thirds_if(x_ptr + nxt * stride_x, cols, W, ok)
            dn0, dn1, dn2 = _load_thirds_if(dy_ptr + nxt * stride_dy, cols, W, ok)
            mean_n = tl.load(mean_ptr + nclamp)
            rstd_n = tl.load(rstd_ptr + nclamp)
            x0, x1, x2, d0, d1, d2, mean, rstd = xc0, xc1, xc2, dc0, dc1, dc2, mean_c, rstd_c
        else:
            x0, x1, x2 = _load_thirds(x_ptr + row * stride_x, cols, W)
            d0, d1, d2 = _load_thirds(dy_ptr + row * stride_dy, cols, W)
            mean = tl.load(mean_ptr + row)
            rstd = tl.load(rstd_ptr + row)
        h0 = (x0.to(tl.float32) - mean) * rstd
        h1 = (x1.to(tl.float32) - mean) * rstd
        h2 = (x2.to(tl.float32) - mean) * rstd
        e0, e1, e2 = d0.to(tl.float32), d1.to(tl.float32), d2.to(tl.float32)
        g0, g1, g2 = e0 * a0, e1 * a1, e2 * a2
        c1 = tl.div_rn(tl.sum((g0 * h0 + g1 * h1) + g2 * h2, axis=0), d_float)
        c2 = tl.div_rn(tl.sum((g0 + g1) + g2, axis=0), d_float)
        out = dx_ptr + row * stride_dx
        dt = dx_ptr.dtype.element_ty
        _store_thirds(out, cols, W, (((g0 - c2) - h0 * c1) * rstd).to(dt), (((g1 - c2) - h1 * c1) * rstd).to(dt),
                      (((g2 - c2) - h2 * c1) * rstd).to(dt))
        if NEED_VEC:
            ps0, ps1, ps2 = ps0 + e0 * h0, ps1 + e1 * h1, ps2 + e2 * h2
            pb0, pb1, pb2 = pb0 + e0, pb1 + e1, pb2 + e2
        if AHEAD:
            xc0, xc1, xc2, dc0, dc1, dc2, mean_c, rstd_c = xn0, xn1, xn2, dn0, dn1, dn2, mean_n, rstd_n
    if NEED_VEC:
        base = part_ptr + c.to(tl.int64) * stride_part
        _store_thirds(base, cols, W, ps0, ps1, ps2)
        _store_thirds(base + D, cols, W, pb0, pb1, pb2)


@triton.jit
def _gate_residual_fwd_kernel(
    x_ptr, y_ptr, gate_ptr, table_ptr, out_ptr,
    n_chunks, D, stride_x, stride_y, stride_gate, stride_out,
    BLOCK_D: tl.constexpr,
):
    """out = x + gate[s]·y for the rows of one chunk; one cast at the store."""
    _, r0, r1, s = _program_chunk(table_ptr, n_chunks)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    gate = _sample_vector(gate_ptr, s, stride_gate, cols, mask)
    first = r0.to(tl.int64)
    for i in range(0, r1 - r0):
        row = first + i
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (x + gate * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate_residual_bwd_kernel(
    dout_ptr, y_ptr, gate_ptr, table_ptr, dy_ptr, part_ptr,
    n_chunks, D, stride_dout, stride_y, stride_gate, stride_dy, stride_part,
    NEED_DY: tl.constexpr, NEED_VEC: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Columns [j·BLOCK_D, (j+1)·BLOCK_D) (j = program_id(1)) of one chunk of sample s: dy = dout·gate[s] per row;
    part[c, cols] = Σ dout·y chained in row order (FP32), one row read ahead. No sum crosses columns, so how the
    columns are split between programs changes no byte (:data:`GATE_BWD_COLS`)."""
    c, r0, r1, s = _program_chunk(table_ptr, n_chunks)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    gate = _sample_vector(gate_ptr, s, stride_gate, cols, mask)
    p = tl.zeros((BLOCK_D,), dtype=tl.float32)
    ylim = D
    if not NEED_VEC:  # y is read only for the gate's partials
        ylim = 0
    ymask = cols < ylim
    first = r0.to(tl.int64)
    dout = tl.load(dout_ptr + first * stride_dout + cols, mask=mask, other=0.0)  # a chunk has >= 1 row
    y = tl.load(y_ptr + first * stride_y + cols, mask=ymask, other=0.0)
    for i in range(0, r1 - r0):
        row = first + i
        nxt = row + 1
        has = nxt < r1
        dout_n = tl.load(dout_ptr + nxt * stride_dout + cols, mask=cols < tl.where(has, D, 0), other=0.0)
        y_n = tl.load(y_ptr + nxt * stride_y + cols, mask=cols < tl.where(has, ylim, 0), other=0.0)
        df = dout.to(tl.float32)
        if NEED_DY:
            tl.store(dy_ptr + row * stride_dy + cols, (df * gate).to(dy_ptr.dtype.element_ty), mask=mask)
        if NEED_VEC:
            p = p + df * y.to(tl.float32)
        dout, y = dout_n, y_n
    if NEED_VEC:
        tl.store(part_ptr + c.to(tl.int64) * stride_part + cols, p, mask=mask)


# ----------------------------------------------------------------------------------------------
# Host functions
# ----------------------------------------------------------------------------------------------


def check_rows(op: str, name: str, t: object, width: int | None = None) -> torch.Tensor:
    """A (M, D) row tensor: fp32|bf16, contiguous, on CUDA (CPU only under TRITON_INTERPRET=1)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{op}: expected {name} of shape (M, D), got {getattr(t, 'shape', type(t).__name__)}")
    check_dtype_device(op, name, t, _interpreting())
    if width is not None and t.shape[1] != width:
        raise ValueError(f"{op}: expected {name} of shape (M, {width}), got {tuple(t.shape)}")
    if not 1 <= t.shape[1] <= MAX_WIDTH:
        raise ValueError(f"{op}: row width {t.shape[1]} outside the supported 1..{MAX_WIDTH}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: expected {name} to be contiguous (row-major), got strides {tuple(t.stride())}")
    return t


def check_vectors(op: str, name: str, v: object, ref: torch.Tensor, samples: int) -> torch.Tensor:
    """Per-sample vectors (B, D): the dtype and device of ``ref``, unit column stride (row stride free)."""
    width = ref.shape[1]
    if not isinstance(v, torch.Tensor) or tuple(v.shape) != (samples, width):
        raise ValueError(f"{op}: expected {name} of shape ({samples}, {width}) (one row per sample), got {getattr(v, 'shape', type(v).__name__)}")
    if v.dtype != ref.dtype:
        raise ValueError(f"{op}: expected {name} of dtype {ref.dtype} (the execution dtype), got {v.dtype}")
    if v.device != ref.device:
        raise ValueError(f"{op}: expected {name} on {ref.device}, got {v.device}")
    if samples and (v.stride(1) != 1 or v.stride(0) < width):
        raise ValueError(f"{op}: expected {name} with unit column stride, got strides {tuple(v.stride())}")
    return v


def _stride0(v: torch.Tensor) -> int:
    return v.stride(0) if v.shape[0] else 0


def ln_thirds(d: int) -> bool:
    """Whether the LayerNorm forward holds a row of width ``d`` as three power-of-two tiles (d = 3·2^k, 2^k >= 16):
    Qwen-Image's 3072 = 3 x 1024. Any other width is one power-of-two tile with the excess lanes masked. The
    choice depends on d alone; it sets the forward's reduction tree (docs/operators.md)."""
    w = d // 3
    return d == 3 * w and w >= 16 and w & (w - 1) == 0


def adaln_modulation_fwd(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, seqlens: tuple[int, ...], eps: float,
                         store_stats: bool, launch: LnLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x (M, D), shift/scale (B, D) → (y (M, D) x's dtype, mean (M,) fp32 | None, rstd (M,) fp32 | None).
    ``launch`` defaults to the one in force (:func:`ln_launch`)."""
    launch = launch or current_ln_launch(x.dtype)
    m, d = x.shape
    y = torch.empty_like(x)
    mean = torch.empty((m,), dtype=torch.float32, device=x.device) if store_stats else None
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device) if store_stats else None
    if m == 0:
        return y, mean, rstd
    ch = seg.chunks(seqlens, x.device, launch.fwd_rows)
    thirds = ln_thirds(d)
    block = d // 3 if thirds else triton.next_power_of_2(d)
    _adaln_mod_fwd_kernel[(ch.n,)](
        x, shift, scale, ch.table, y, mean if store_stats else y, rstd if store_stats else y,
        ch.n, d, float(d), float(eps), x.stride(0), y.stride(0), _stride0(shift), _stride0(scale),
        STORE_STATS=store_stats, AHEAD=launch.fwd_ahead, STAGES=launch.fwd_stages, BLOCK_D=block, THIRDS=thirds,
        ONE_ROW=thirds and launch.fwd_rows == 1 and not launch.fwd_ahead and launch.fwd_stages is None,
        **launch_opts(num_warps_for(block), _interpreting(), maxnreg=launch.fwd_maxnreg),
    )
    return y, mean, rstd


def adaln_modulation_bwd(dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                         seqlens: tuple[int, ...], need_vec: bool, launch: LnLaunch | None = None,
                         thirds: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Returns (dx (M, D), d_shift (B, D) | None, d_scale (B, D) | None), all in x's dtype; ``launch`` as in
    :func:`adaln_modulation_fwd`. ``thirds`` (None: :func:`ln_thirds`) holds a row as three tiles: the row sums of
    dx take the forward's thirds tree; d_scale / d_shift keep their bytes (per-column chains) either way. The
    warps come from D alone (pow2(D)), thirds or not."""
    launch = launch or current_ln_launch(x.dtype)
    m, d = x.shape
    thirds = ln_thirds(d) if thirds is None else thirds and ln_thirds(d)
    dx = torch.empty_like(x)
    ch = seg.chunks(seqlens, x.device)
    part = torch.empty((ch.n, 2 * d), dtype=torch.float32, device=x.device) if need_vec else None
    if m:
        block = d // 3 if thirds else triton.next_power_of_2(d)
        _adaln_mod_bwd_kernel[(ch.n,)](
            x, scale, dy, mean, rstd, ch.table, dx, part if need_vec else dx,
            ch.n, d, float(d), x.stride(0), dy.stride(0), dx.stride(0), _stride0(scale), 2 * d,
            NEED_VEC=need_vec, AHEAD=launch.bwd_ahead, STAGES=launch.bwd_stages, BLOCK_D=block, THIRDS=thirds,
            **launch_opts(num_warps_for(triton.next_power_of_2(d)), _interpreting(), maxnreg=launch.bwd_maxnreg),
        )
    if not need_vec:
        return dx, None, None
    vec = seg.per_sample_sums(part, ch, x.dtype, _interpreting())  # (B, 2D): [d_scale | d_shift]
    return dx, vec[:, d:], vec[:, :d]


class AdalnModulationFunction(torch.autograd.Function):
    """Autograd for :func:`adaln_modulation`: gradients of x, shift and scale."""

    @staticmethod
    def forward(ctx, x, shift, scale, seqlens, eps):  # type: ignore[override]
        ctx.launch = current_ln_launch(x.dtype)
        y, mean, rstd = adaln_modulation_fwd(x, shift, scale, seqlens, eps, store_stats=True, launch=ctx.launch)
        ctx.save_for_backward(x, scale, mean, rstd)
        ctx.seqlens = seqlens
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, scale, mean, rstd = ctx.saved_tensors
        need_vec = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        dx, dshift, dscale = adaln_modulation_bwd(dy.contiguous(), x, scale, mean, rstd, ctx.seqlens, need_vec,
                                                  launch=ctx.launch)
        return dx, dshift, dscale, None, None


def _wants_grad(*ts: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def adaln_modulation(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, *, seqlens: Sequence[int], eps: float) -> torch.Tensor:
    """``LayerNorm(x)·(1 + scale[s]) + shift[s]``: x (M, D) fp32|bf16, shift/scale (B, D) same dtype → (M, D).

    Row-local forward (FP32, one cast); d_shift/d_scale per sample on the fixed tree of :mod:`.segments`."""
    op = "adaln_modulation"
    check_rows(op, "x", x)
    seq = check_seqlens(op, seqlens, x.shape[0])
    check_vectors(op, "shift", shift, x, len(seq))
    check_vectors(op, "scale", scale, x, len(seq))
    if _wants_grad(x, shift, scale):
        return AdalnModulationFunction.apply(x, shift, scale, seq, float(eps))
    return adaln_modulation_fwd(x, shift, scale, seq, float(eps), store_stats=False)[0]


def gate_residual_fwd(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, seqlens: tuple[int, ...]) -> torch.Tensor:
    """x, y (M, D), gate (B, D) → x + gate[s]·y (M, D)."""
    m, d = x.shape
    out = torch.empty_like(x)
    if m == 0:
        return out
    ch = seg.chunks(seqlens, x.device, FWD_ROWS)
    block = triton.next_power_of_2(d)
    _gate_residual_fwd_kernel[(ch.n,)](
        x, y, gate, ch.table, out, ch.n, d, x.stride(0), y.stride(0), _stride0(gate), out.stride(0),
        BLOCK_D=block, **launch_opts(num_warps_for(block), _interpreting()),
    )
    return out


def gate_residual_bwd(dout: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, seqlens: tuple[int, ...], need_dy: bool,
                      need_gate: bool, cols: int | None = None,
                      chunk_rows: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Returns (dy (M, D) | None, d_gate (B, D) | None) in y's dtype. ``cols`` (None: :data:`GATE_BWD_COLS`, a power
    of two): columns a program, ``min(pow2(D), cols)``; a launch choice only (every element's arithmetic is the same).
    ``chunk_rows`` (None: segments.CHUNK_ROWS) is the d_gate tree's chunk length (another length, other d_gate
    bytes: probes only)."""
    if cols is not None and (cols < 1 or cols & (cols - 1)):
        raise ValueError(f"gate_residual_bwd: cols must be a power of two, got {cols}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"gate_residual_bwd: chunk_rows must be >= 1, got {chunk_rows}")
    m, d = y.shape
    block = min(triton.next_power_of_2(d), cols or GATE_BWD_COLS)
    dy = torch.empty_like(y) if need_dy else None
    ch = seg.chunks(seqlens, y.device, chunk_rows or seg.CHUNK_ROWS)
    part = torch.empty((ch.n, d), dtype=torch.float32, device=y.device) if need_gate else None
    if m and (need_dy or need_gate):
        _gate_residual_bwd_kernel[(ch.n, triton.cdiv(d, block))](
            dout, y, gate, ch.table, dy if need_dy else dout, part if need_gate else dout,
            ch.n, d, dout.stride(0), y.stride(0), _stride0(gate), y.stride(0), d,
            NEED_DY=need_dy, NEED_VEC=need_gate, BLOCK_D=block,
            **launch_opts(num_warps_for(block), _interpreting()),
        )
    dgate = seg.per_sample_sums(part, ch, y.dtype, _interpreting()) if need_gate else None
    return dy, dgate


class GateResidualFunction(torch.autograd.Function):
    """Autograd for :func:`adaln_gate_residual`: dx = dout, dy = dout·gate, d_gate per sample."""

    @staticmethod
    def forward(ctx, x, y, gate, seqlens):  # type: ignore[override]
        ctx.save_for_backward(y, gate)
        ctx.seqlens = seqlens
        return gate_residual_fwd(x, y, gate, seqlens)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        y, gate = ctx.saved_tensors
        dout = dout.contiguous()
        dy, dgate = gate_residual_bwd(dout, y, gate, ctx.seqlens, ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        return (dout if ctx.needs_input_grad[0] else None), dy, dgate, None


def adaln_gate_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, *, seqlens: Sequence[int]) -> torch.Tensor:
    """``x + gate[s]·y``: x, y (M, D) fp32|bf16, gate (B, D) → (M, D); FP32 math, one cast.
    d_gate per sample on the fixed tree of :mod:`.segments`."""
    op = "adaln_gate_residual"
    check_rows(op, "x", x)
    check_rows(op, "y", y, x.shape[1])
    if y.shape != x.shape or y.dtype != x.dtype or y.device != x.device:
        raise ValueError(f"{op}: x {tuple(x.shape)} {x.dtype} and y {tuple(y.shape)} {y.dtype} must match")
    seq = check_seqlens(op, seqlens, x.shape[0])
    check_vectors(op, "gate", gate, x, len(seq))
    if _wants_grad(x, y, gate):
        return GateResidualFunction.apply(x, y, gate, seq)
    return gate_residual_fwd(x, y, gate, seq)


def final_adaln_out(x: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                    seqlens: Sequence[int], eps: float, lora: tuple | None = None) -> torch.Tensor:
    """``scale, shift = SiLU(temb) Wᵀ + b`` (that order; GEMM engine, one row per sample), then
    ``LayerNorm(x)·(1 + scale[s]) + shift[s]``. x (M, D), temb (B, D), weight (2D, D), bias (2D,) → (M, D).

    The halves of the (B, 2D) modulation are read in place (row stride 2D); their gradients flow back
    through the GEMM engine's per-sample dW/db folds."""
    op = "final_adaln_out"
    check_rows(op, "x", x)
    seq = check_seqlens(op, seqlens, x.shape[0])
    d = x.shape[1]
    if not isinstance(temb, torch.Tensor) or temb.dim() != 2 or temb.shape[0] != len(seq):
        raise ValueError(f"{op}: expected temb of shape ({len(seq)}, K), got {getattr(temb, 'shape', type(temb).__name__)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != 2 * d:
        raise ValueError(f"{op}: expected weight of shape ({2 * d}, K) (scale rows, then shift rows), got {getattr(weight, 'shape', type(weight).__name__)}")
    mod = gemm(temb, weight, bias, seqlens=(1,) * len(seq), prologue="silu", lora=lora)  # (B, 2D)
    return adaln_modulation(x, mod[:, d:], mod[:, :d], seqlens=seq, eps=eps)


def txt_in_rmsnorm_linear(x: torch.Tensor, gain: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                          seqlens: Sequence[int], eps: float, lora: tuple | None = None) -> torch.Tensor:
    """``(RMSNorm(x)·gain) Wᵀ + b``: x (M, Ct), gain (Ct,) → (M, N). The normalized rows are written once in
    the execution dtype (the RMSNorm of :mod:`.rope` with one head of width Ct), then the GEMM engine."""
    op = "txt_in_rmsnorm_linear"
    check_rows(op, "x", x)
    seq = check_seqlens(op, seqlens, x.shape[0])
    check_gain(op, gain, x)
    h = rms_norm_rows(x, gain, seqlens=seq, eps=eps)
    return gemm(h, weight, bias, seqlens=seq, lora=lora)


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------

_TREE = (f"per sample: rows chained in {seg.CHUNK_ROWS}-row chunks from the sample's first row, chunk partials "
         f"summed {seg.FOLD_TILE} per tl.sum tile, tiles chained; FP32")
_LN = ("row: tl.sum over D (fixed for the compiled kernel; warps from D only), div_rn/sqrt_rn; with D = 3*2^k (3072) "
       "forward and backward hold the three 2^k-lane thirds, each row sum adding them lane by lane ((t0 + t1) + t2), "
       "then tl.sum over one third")
_CONFIG = {"ln_launch": {str(dt).replace("torch.", ""): launch.label() for dt, launch in LN_DEFAULTS.items()},
           "gate_fwd_rows_per_program": FWD_ROWS, "gate_bwd_columns_per_program": GATE_BWD_COLS,
           "chunk_rows": seg.CHUNK_ROWS, "fold_tile": seg.FOLD_TILE,
           "warps": "4 if pow2(D) <= 1024, 8 if <= 4096, else 16", "fp_fusion": False}
_SOURCE = sys.modules[__name__]
_DT = frozenset(_DTYPES)
for _op, _fn, _kernel, _order in (
    ("adaln_modulation", adaln_modulation, "_adaln_mod_fwd_kernel/_adaln_mod_bwd_kernel/_segment_fold_kernel",
     f"{_LN}; d_scale/d_shift {_TREE}"),
    ("adaln_gate_residual", adaln_gate_residual, "_gate_residual_fwd_kernel/_gate_residual_bwd_kernel/_segment_fold_kernel",
     f"elementwise forward; d_gate {_TREE}"),
    ("final_adaln_out", final_adaln_out, "_gemm_fwd_kernel (silu prologue) + _adaln_mod_fwd_kernel/_adaln_mod_bwd_kernel",
     f"modulation GEMM as the strict GEMM engine (one row per sample); {_LN}; d_scale/d_shift {_TREE}"),
    ("txt_in_rmsnorm_linear", txt_in_rmsnorm_linear, "_qk_fwd_kernel (one head) + _gemm_fwd_kernel",
     f"RMSNorm row: tl.sum of squares over Ct, div_rn/sqrt_rn, gain gradient {_TREE}, samples folded left in order; "
     "then the strict GEMM engine"),
):
    register(KernelImpl(op=_op, backend="triton", device="cuda", dtypes=_DT, fn=_fn, strict=True, split_k=False, kernel_name=_kernel,
                        source=_SOURCE, config=dict(_CONFIG), reduction_order=_order, accumulator="fp32"))

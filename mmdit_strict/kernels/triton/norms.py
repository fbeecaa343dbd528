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
  over the row (a fixed tree for the compiled kernel; the configuration depends on D only).
  One cast to the storage dtype at ``y``. ``mean`` and ``rstd`` (FP32, per row) are saved for backward.
* LayerNorm-modulation backward: ``g = dy·(1 + scale)``, ``dx = ((g − Σg ⊘ D) − x̂·(Σg·x̂ ⊘ D))·rstd``;
  ``d_scale[s] = Σ_rows dy·x̂`` and ``d_shift[s] = Σ_rows dy`` on the per-sample tree of :mod:`.segments`.
* Gated residual: ``out = x + gate·y``; backward ``dx = dout`` (the same tensor), ``dy = dout·gate``,
  ``d_gate[s] = Σ_rows dout·y`` (per-sample tree).

A row's forward bytes depend only on the row and its sample's vectors; the per-sample sums depend only on
that sample's rows. Per-sample vectors are read through their row stride (views such as the halves of
the final modulation need no copy); rows must be contiguous.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Sequence

import torch
import triton
import triton.language as tl

from ..choice import KernelChoice
from ..registry import KernelImpl, register
from . import segments as seg
from .gemm import _DTYPES, _interpreting, gemm
from .rope import check_gain, rms_norm_rows
from .segments import check_seqlens

FWD_ROWS = 4  # rows per forward program (row-local math: no effect on bytes)
MAX_WIDTH = 16384


# How the LayerNorm kernels of adaln_modulation / final_adaln_out walk a chunk (chosen with :func:`ln_variant`):
# "one_row" (the default, DEFAULT_LN_VARIANT): a row at a time, each row sum its own tl.sum (a shared-memory round trip each);
# "two_rows": rows two at a time, the sums of both rows in ONE multi-operand tl.reduce (the backward's four
# sums Σg·x̂, Σg of both rows in one), each operand combined by the same ``a + b`` over the same layout as
# its tl.sum would be, the per-sample chains still row after row. Meant to give the same bytes (the GPU
# test compares them with "one_row"); off until the H200 qualifies it. An autograd node keeps its forward's.
LN_VARIANTS = ("one_row", "two_rows")
DEFAULT_LN_VARIANT = "one_row"
_LN_VAR = KernelChoice("LayerNorm variant", LN_VARIANTS, DEFAULT_LN_VARIANT)


def current_ln_variant() -> str:
    """The LayerNorm kernel variant in force (the innermost :func:`ln_variant`, else :data:`DEFAULT_LN_VARIANT`)."""
    return _LN_VAR.current()


def ln_variant(name: str) -> contextlib.AbstractContextManager[None]:
    """Run adaln_modulation / final_adaln_out inside the block with LayerNorm variant ``name`` (:data:`LN_VARIANTS`)."""
    return _LN_VAR.use(name)


def num_warps_for(block: int) -> int:
    """Warps per program from the padded row width (never from M): 4 up to 1024, 8 up to 4096, else 16."""
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _opts(block: int) -> dict:
    return {} if _interpreting() else {"num_warps": num_warps_for(block), "enable_fp_fusion": False}


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
    STORE_STATS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """y = x̂·(1 + scale[s]) + shift[s] for the rows of one chunk (all of sample s); one cast at the store."""
    _, r0, r1, s = _program_chunk(table_ptr, n_chunks)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    scale1 = 1.0 + _sample_vector(scale_ptr, s, stride_scale, cols, mask)
    shift = _sample_vector(shift_ptr, s, stride_shift, cols, mask)
    first = r0.to(tl.int64)
    for i in range(0, r1 - r0):
        row = first + i
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        mean, rstd, xhat = _layer_norm_row(x, mask, d_float, eps)
        y = xhat * scale1 + shift
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        if STORE_STATS:
            tl.store(mean_ptr + row, mean)
            tl.store(rstd_ptr + row, rstd)


@triton.jit
def _adaln_mod_bwd_kernel(
    x_ptr, scale_ptr, dy_ptr, mean_ptr, rstd_ptr, table_ptr, dx_ptr, part_ptr,
    n_chunks, D, d_float, stride_x, stride_dy, stride_dx, stride_scale, stride_part,
    NEED_VEC: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One chunk (≤ CHUNK_ROWS rows of sample s): dx per row, and the chunk's partials
    part[c, :D] = Σ dy·x̂, part[c, D:] = Σ dy chained in row order (FP32). The next row's x and dy are
    loaded before the current row is reduced (a register double buffer; no effect on the arithmetic)."""
    c, r0, r1, s = _program_chunk(table_ptr, n_chunks)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    scale1 = 1.0 + _sample_vector(scale_ptr, s, stride_scale, cols, mask)
    p_scale = tl.zeros((BLOCK_D,), dtype=tl.float32)
    p_shift = tl.zeros((BLOCK_D,), dtype=tl.float32)
    row = r0.to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0)
    mean = tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    first = r0.to(tl.int64)
    for i in range(0, r1 - r0):
        row = first + i
        nxt = row + 1
        nmask = cols < tl.where(nxt < r1, D, 0)  # nothing past the chunk's last row is read
        nclamp = tl.minimum(nxt, r1 - 1)
        x_n = tl.load(x_ptr + nxt * stride_x + cols, mask=nmask, other=0.0)
        dy_n = tl.load(dy_ptr + nxt * stride_dy + cols, mask=nmask, other=0.0)
        mean_n = tl.load(mean_ptr + nclamp)
        rstd_n = tl.load(rstd_ptr + nclamp)
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
        x, dy, mean, rstd = x_n, dy_n, mean_n, rstd_n
    if NEED_VEC:
        _store_scale_shift_partials(part_ptr, c, stride_part, D, cols, mask, p_scale, p_shift)


# ---- the "two_rows" LayerNorm variant --------------------------------------------------------


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _layer_norm_rows2(xa, xb, mask, d_float, eps):
    """(mean, rstd, x̂) of two FP32 rows a and b (masked lanes 0), the formulas of :func:`_layer_norm_row`;
    each Σ pairs the two rows in one two-operand ``tl.reduce`` (per operand the ``a + b`` of ``tl.sum``)."""
    sa, sb = tl.reduce((xa, xb), 0, _add2)
    mean_a = tl.div_rn(sa, d_float)
    mean_b = tl.div_rn(sb, d_float)
    xca = tl.where(mask, xa - mean_a, 0.0)
    xcb = tl.where(mask, xb - mean_b, 0.0)
    qa, qb = tl.reduce((xca * xca, xcb * xcb), 0, _add2)
    rstd_a = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(qa, d_float) + eps))
    rstd_b = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(qb, d_float) + eps))
    return mean_a, rstd_a, xca * rstd_a, mean_b, rstd_b, xcb * rstd_b


@triton.jit
def _adaln_mod_fwd2_kernel(
    x_ptr, shift_ptr, scale_ptr, table_ptr, y_ptr, mean_ptr, rstd_ptr,
    n_chunks, D, d_float, eps, stride_x, stride_y, stride_shift, stride_scale,
    STORE_STATS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """:func:`_adaln_mod_fwd_kernel`'s rows two at a time (row b masked off past the chunk)."""
    _, r0, r1, s = _program_chunk(table_ptr, n_chunks)
    n = r1 - r0
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    scale1 = 1.0 + _sample_vector(scale_ptr, s, stride_scale, cols, mask)
    shift = _sample_vector(shift_ptr, s, stride_shift, cols, mask)
    first = r0.to(tl.int64)
    for i in range(0, n, 2):
        row = first + i
        has_b = i + 1 < n
        mask_b = cols < tl.where(has_b, D, 0)
        xa = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        xb = tl.load(x_ptr + (row + 1) * stride_x + cols, mask=mask_b, other=0.0).to(tl.float32)
        mean_a, rstd_a, xhat_a, mean_b, rstd_b, xhat_b = _layer_norm_rows2(xa, xb, mask, d_float, eps)
        tl.store(y_ptr + row * stride_y + cols, (xhat_a * scale1 + shift).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_ptr + (row + 1) * stride_y + cols, (xhat_b * scale1 + shift).to(y_ptr.dtype.element_ty), mask=mask_b)
        if STORE_STATS:
            tl.store(mean_ptr + row, mean_a)
            tl.store(rstd_ptr + row, rstd_a)
            tl.store(mean_ptr + row + 1, mean_b, mask=has_b)
            tl.store(rstd_ptr + row + 1, rstd_b, mask=has_b)


@triton.jit
def _ln_bwd_row_load(x_ptr, dy_ptr, mean_ptr, rstd_ptr, row, live, cols, D, stride_x, stride_dy):
    """x and dy (storage dtype), mean and rstd of ``row``; zeros (nothing read) when not ``live``."""
    m = cols < tl.where(live, D, 0)
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=m, other=0.0)
    mean = tl.load(mean_ptr + row, mask=live, other=0.0)
    rstd = tl.load(rstd_ptr + row, mask=live, other=0.0)
    return x, dy, mean, rstd


@triton.jit
def _adaln_mod_bwd2_kernel(
    x_ptr, scale_ptr, dy_ptr, mean_ptr, rstd_ptr, table_ptr, dx_ptr, part_ptr,
    n_chunks, D, d_float, stride_x, stride_dy, stride_dx, stride_scale, stride_part,
    NEED_VEC: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """:func:`_adaln_mod_bwd_kernel`'s arithmetic with the rows two at a time (a, b): the four row sums
    Σg·x̂ and Σg of both rows are ONE four-operand ``tl.reduce``, the partials still chain
    acc + t_a, then + t_b (row b skipped past the chunk), and the next pair is read meanwhile."""
    c, r0, r1, s = _program_chunk(table_ptr, n_chunks)
    n = r1 - r0
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    scale1 = 1.0 + _sample_vector(scale_ptr, s, stride_scale, cols, mask)
    p_scale = tl.zeros((BLOCK_D,), dtype=tl.float32)
    p_shift = tl.zeros((BLOCK_D,), dtype=tl.float32)
    first = r0.to(tl.int64)
    xa, dya, ma, ra = _ln_bwd_row_load(x_ptr, dy_ptr, mean_ptr, rstd_ptr, first, n > 0, cols, D, stride_x, stride_dy)
    xb, dyb, mb, rb = _ln_bwd_row_load(x_ptr, dy_ptr, mean_ptr, rstd_ptr, first + 1, n > 1, cols, D, stride_x, stride_dy)
    for i in range(0, n, 2):
        row = first + i
        has_b = i + 1 < n
        xa_n, dya_n, ma_n, ra_n = _ln_bwd_row_load(x_ptr, dy_ptr, mean_ptr, rstd_ptr, row + 2, i + 2 < n, cols, D,
                                                   stride_x, stride_dy)
        xb_n, dyb_n, mb_n, rb_n = _ln_bwd_row_load(x_ptr, dy_ptr, mean_ptr, rstd_ptr, row + 3, i + 3 < n, cols, D,
                                                   stride_x, stride_dy)
        xhat_a = tl.where(mask, xa.to(tl.float32) - ma, 0.0) * ra
        xhat_b = tl.where(mask, xb.to(tl.float32) - mb, 0.0) * rb
        dyf_a = dya.to(tl.float32)
        dyf_b = dyb.to(tl.float32)
        g_a = dyf_a * scale1
        g_b = dyf_b * scale1
        s1a, s2a, s1b, s2b = tl.reduce((g_a * xhat_a, g_a, g_b * xhat_b, g_b), 0, _add4)
        dx_a = ((g_a - tl.div_rn(s2a, d_float)) - xhat_a * tl.div_rn(s1a, d_float)) * ra
        dx_b = ((g_b - tl.div_rn(s2b, d_float)) - xhat_b * tl.div_rn(s1b, d_float)) * rb
        tl.store(dx_ptr + row * stride_dx + cols, dx_a.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + (row + 1) * stride_dx + cols, dx_b.to(dx_ptr.dtype.element_ty), mask=cols < tl.where(has_b, D, 0))
        if NEED_VEC:
            p_scale = p_scale + dyf_a * xhat_a
            p_shift = p_shift + dyf_a
            p_scale = tl.where(has_b, p_scale + dyf_b * xhat_b, p_scale)
            p_shift = tl.where(has_b, p_shift + dyf_b, p_shift)
        xa, dya, ma, ra = xa_n, dya_n, ma_n, ra_n
        xb, dyb, mb, rb = xb_n, dyb_n, mb_n, rb_n
    if NEED_VEC:
        _store_scale_shift_partials(part_ptr, c, stride_part, D, cols, mask, p_scale, p_shift)


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
    """One chunk of sample s: dy = dout·gate[s] per row; part[c] = Σ dout·y chained in row order (FP32)."""
    c, r0, r1, s = _program_chunk(table_ptr, n_chunks)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    gate = _sample_vector(gate_ptr, s, stride_gate, cols, mask)
    p = tl.zeros((BLOCK_D,), dtype=tl.float32)
    ylim = D
    if not NEED_VEC:  # y is read only for the gate's partials
        ylim = 0
    ymask = cols < ylim
    row = r0.to(tl.int64)
    dout = tl.load(dout_ptr + row * stride_dout + cols, mask=mask, other=0.0)
    y = tl.load(y_ptr + row * stride_y + cols, mask=ymask, other=0.0)
    first = r0.to(tl.int64)
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


def _device_ok(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" or (_interpreting() and t.device.type == "cpu")


def check_rows(op: str, name: str, t: object, width: int | None = None) -> torch.Tensor:
    """A (M, D) row tensor: fp32|bf16, contiguous, on CUDA (CPU only under TRITON_INTERPRET=1)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{op}: expected {name} of shape (M, D), got {getattr(t, 'shape', type(t).__name__)}")
    if t.dtype not in _DTYPES:
        raise ValueError(f"{op}: strict kernels run fp32 or bf16, got {name} of dtype {t.dtype}")
    if not _device_ok(t):
        raise ValueError(f"{op}: the triton backend needs CUDA tensors (CPU only under TRITON_INTERPRET=1), got {name} on {t.device}")
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


def _check_ln_variant(variant: str | None) -> str:
    variant = variant or _LN_VAR.current()
    if variant not in LN_VARIANTS:
        raise ValueError(f"LayerNorm variant must be one of {LN_VARIANTS}, got {variant!r}")
    return variant


def adaln_modulation_fwd(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, seqlens: tuple[int, ...], eps: float,
                         store_stats: bool, variant: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x (M, D), shift/scale (B, D) → (y (M, D) x's dtype, mean (M,) fp32 | None, rstd (M,) fp32 | None).
    ``variant`` (:data:`LN_VARIANTS`) defaults to the one in force (:func:`ln_variant`)."""
    kernel = _adaln_mod_fwd2_kernel if _check_ln_variant(variant) == "two_rows" else _adaln_mod_fwd_kernel
    m, d = x.shape
    y = torch.empty_like(x)
    mean = torch.empty((m,), dtype=torch.float32, device=x.device) if store_stats else None
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device) if store_stats else None
    if m == 0:
        return y, mean, rstd
    ch = seg.chunks(seqlens, x.device, FWD_ROWS)
    block = triton.next_power_of_2(d)
    kernel[(ch.n,)](
        x, shift, scale, ch.table, y, mean if store_stats else y, rstd if store_stats else y,
        ch.n, d, float(d), float(eps), x.stride(0), y.stride(0), _stride0(shift), _stride0(scale),
        STORE_STATS=store_stats, BLOCK_D=block, **_opts(block),
    )
    return y, mean, rstd


def adaln_modulation_bwd(dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                         seqlens: tuple[int, ...], need_vec: bool,
                         variant: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Returns (dx (M, D), d_shift (B, D) | None, d_scale (B, D) | None), all in x's dtype; ``variant`` as in
    :func:`adaln_modulation_fwd`."""
    kernel = _adaln_mod_bwd2_kernel if _check_ln_variant(variant) == "two_rows" else _adaln_mod_bwd_kernel
    m, d = x.shape
    dx = torch.empty_like(x)
    ch = seg.chunks(seqlens, x.device)
    part = torch.empty((ch.n, 2 * d), dtype=torch.float32, device=x.device) if need_vec else None
    if m:
        block = triton.next_power_of_2(d)
        kernel[(ch.n,)](
            x, scale, dy, mean, rstd, ch.table, dx, part if need_vec else dx,
            ch.n, d, float(d), x.stride(0), dy.stride(0), dx.stride(0), _stride0(scale), 2 * d,
            NEED_VEC=need_vec, BLOCK_D=block, **_opts(block),
        )
    if not need_vec:
        return dx, None, None
    vec = seg.per_sample_sums(part, ch, x.dtype, _interpreting())  # (B, 2D): [d_scale | d_shift]
    return dx, vec[:, d:], vec[:, :d]


class AdalnModulationFunction(torch.autograd.Function):
    """Autograd for :func:`adaln_modulation`: gradients of x, shift and scale."""

    @staticmethod
    def forward(ctx, x, shift, scale, seqlens, eps):  # type: ignore[override]
        ctx.variant = _LN_VAR.current()
        y, mean, rstd = adaln_modulation_fwd(x, shift, scale, seqlens, eps, store_stats=True, variant=ctx.variant)
        ctx.save_for_backward(x, scale, mean, rstd)
        ctx.seqlens = seqlens
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, scale, mean, rstd = ctx.saved_tensors
        need_vec = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        dx, dshift, dscale = adaln_modulation_bwd(dy.contiguous(), x, scale, mean, rstd, ctx.seqlens, need_vec,
                                                    variant=ctx.variant)
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
        BLOCK_D=block, **_opts(block),
    )
    return out


def gate_residual_bwd(dout: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, seqlens: tuple[int, ...], need_dy: bool,
                      need_gate: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Returns (dy (M, D) | None, d_gate (B, D) | None) in y's dtype."""
    m, d = y.shape
    dy = torch.empty_like(y) if need_dy else None
    ch = seg.chunks(seqlens, y.device)
    part = torch.empty((ch.n, d), dtype=torch.float32, device=y.device) if need_gate else None
    if m and (need_dy or need_gate):
        block = triton.next_power_of_2(d)
        _gate_residual_bwd_kernel[(ch.n,)](
            dout, y, gate, ch.table, dy if need_dy else dout, part if need_gate else dout,
            ch.n, d, dout.stride(0), y.stride(0), _stride0(gate), y.stride(0), d,
            NEED_DY=need_dy, NEED_VEC=need_gate, BLOCK_D=block, **_opts(block),
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
_LN = "row: tl.sum over D (fixed for the compiled kernel; warps from D only), div_rn/sqrt_rn"
_CONFIG = {"fwd_rows_per_program": FWD_ROWS, "chunk_rows": seg.CHUNK_ROWS, "fold_tile": seg.FOLD_TILE,
           "warps": "4 if pow2(D) <= 1024, 8 if <= 4096, else 16", "fp_fusion": False}
_SOURCE = sys.modules[__name__]
_DT = frozenset(_DTYPES)
_LN2 = ("row pairs: both rows' Σ in one multi-operand tl.reduce (per operand tl.sum's a + b, same layout), "
        "fixed for the compiled kernel; warps from D only; div_rn/sqrt_rn")


def _ln_identity(op: str):
    """The registry's ``variant`` hook of a LayerNorm operator: its kernels and tree under :func:`ln_variant`."""
    gemm_part = "_gemm_fwd_kernel (silu prologue) + " if op == "final_adaln_out" else ""
    gemm_order = "modulation GEMM as the strict GEMM engine (one row per sample); " if op == "final_adaln_out" else ""
    tail = "/_segment_fold_kernel" if op == "adaln_modulation" else ""

    def identity() -> dict:
        name = _LN_VAR.current()
        two = name == "two_rows"
        kernels = "_adaln_mod_fwd2_kernel/_adaln_mod_bwd2_kernel" if two else "_adaln_mod_fwd_kernel/_adaln_mod_bwd_kernel"
        return {"variant": name, "kernel": f"{gemm_part}{kernels}{tail}",
                "reduction_order": f"{gemm_order}{_LN2 if two else _LN}; d_scale/d_shift {_TREE}"}

    return identity


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
    _pick = _ln_identity(_op) if _op in ("adaln_modulation", "final_adaln_out") else None
    if _pick is not None:  # the registered kernels and tree are the default variant's
        with ln_variant(DEFAULT_LN_VARIANT):
            _kernel, _order = _pick()["kernel"], _pick()["reduction_order"]
    register(KernelImpl(op=_op, backend="triton", device="cuda", dtypes=_DT, fn=_fn, strict=True, split_k=False, kernel_name=_kernel,
                        source=_SOURCE, config=dict(_CONFIG), reduction_order=_order, accumulator="fp32", variant=_pick))

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
that sample's rows. Per-sample vectors are read through their row stride (views such as the halves of the final
modulation need no copy); rows must be contiguous.

Launch configuration: :data:`LN_CONFIGS`, a read-only table of :class:`LnConfig` keyed by the execution dtype
(rows per forward program, read-ahead, register cap, pipelined loops of the LayerNorm kernels). No entry changes a
byte (the tiles and warps come from D alone). A benchmark passes another configuration as the ``config=`` argument
of :func:`adaln_modulation_fwd` / :func:`adaln_modulation_bwd` (or of :func:`adaln_modulation` /
:func:`final_adaln_out`); nothing else selects one. The kernels are in :mod:`.norms_kernels`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Sequence

import torch

from ..registry import KernelImpl, register
from . import norms_kernels
from . import segments as seg
from .bound import bound, cdiv, next_power_of_2
from .gemm import DTYPES, interpreting, check_dtype_device, gemm, launch_opts
from .norms_kernels import (_adaln_mod_bwd_kernel, _adaln_mod_fwd_kernel, _gate_residual_bwd_kernel,
                            _gate_residual_fwd_kernel)
from .rope import check_gain, check_stages, num_warps_for, rms_norm_rows, stages_label
from .segments import check_seqlens

FWD_ROWS = 4  # rows per gated-residual forward program (row-local math: no effect on bytes)
# Columns per gated-residual backward program (a power of two). The backward has no sum across columns, so a chunk's
# columns split over programs give the same bytes as one program per chunk (tested): 3072 columns are three programs
# of 1024 lanes and 4 warps each, 768 programs at 4096 rows instead of 256.
GATE_BWD_COLS = 1024
MAX_WIDTH = 16384



@dataclass(frozen=True)
class LnConfig:
    """How the LayerNorm kernels of adaln_modulation / final_adaln_out are launched. None of it touches the
    arithmetic: the same formulas, the same tiles (from D only: pow2(D) lanes, or three D/3-lane thirds, see
    :func:`ln_thirds`; warps from the tile), hence the same register layout and tree for every tl.sum; none of it
    is chosen from the number of rows.

    fwd_rows: rows per forward program (the forward has no cross-row sum: any grouping gives the same bytes; one
    row, no read-ahead, no stages takes the loop-free thirds kernel where D is three powers of two);
    fwd_ahead / bwd_ahead: 1 = the kernel reads row r+1 while it reduces row r (a register double buffer), 0 = not;
    fwd_maxnreg / bwd_maxnreg: a register cap for ptxas (more programs resident per SM; may spill), None = none;
    fwd_stages / bwd_stages: None, or 2..8 = the row loop software-pipelined by Triton (``tl.range(num_stages=)``):
    the next rows' loads go through shared memory instead of registers, into the same register layout; with
    stages, ahead is 0. The backward's chunks stay segments.CHUNK_ROWS rows (they are the d_scale / d_shift tree)."""

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

    def check(self) -> LnConfig:
        """Self, or ValueError for a launch the kernels cannot run."""
        if self.fwd_rows < 1 or {self.fwd_ahead, self.bwd_ahead} - {0, 1}:
            raise ValueError(f"expected an LnConfig with fwd_rows >= 1 and fwd_ahead / bwd_ahead 0 or 1, got {self!r}")
        check_stages(self.fwd_stages, self.fwd_ahead, "LnConfig forward")
        check_stages(self.bwd_stages, self.bwd_ahead, "LnConfig backward")
        return self


# Keyed by the execution dtype. Forward: one row per program (the loop-free thirds kernel at D = 3072);
# backward: one row read ahead, at most 128 registers a thread. Measurements: experiments/norms/.
LN_CONFIGS: Mapping[torch.dtype, LnConfig] = MappingProxyType({
    torch.bfloat16: LnConfig(fwd_rows=1, fwd_ahead=0, bwd_ahead=1, bwd_maxnreg=128),
    torch.float32: LnConfig(fwd_rows=1, fwd_ahead=0, bwd_ahead=1, bwd_maxnreg=128),
})


def ln_config(dtype: torch.dtype) -> LnConfig:
    """The frozen LayerNorm launch of ``dtype``."""
    return LN_CONFIGS[dtype]


def _ln_config(config: object, dtype: torch.dtype) -> LnConfig:
    """``config`` checked, or the frozen launch of ``dtype`` when it is None."""
    if config is None:
        return LN_CONFIGS[dtype]
    if not isinstance(config, LnConfig):
        raise ValueError(f"expected an LnConfig, got {config!r}")
    return config.check()


# ----------------------------------------------------------------------------------------------
# Host functions
# ----------------------------------------------------------------------------------------------


def check_rows(op: str, name: str, t: object, width: int | None = None) -> torch.Tensor:
    """A (M, D) row tensor: fp32|bf16, contiguous, on CUDA (CPU only under TRITON_INTERPRET=1)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{op}: expected {name} of shape (M, D), got {getattr(t, 'shape', type(t).__name__)}")
    check_dtype_device(op, name, t, interpreting())
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
                         store_stats: bool, config: LnConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x (M, D), shift/scale (B, D) → (y (M, D) x's dtype, mean (M,) fp32 | None, rstd (M,) fp32 | None).
    ``config``: the launch (default: :data:`LN_CONFIGS`)."""
    launch = _ln_config(config, x.dtype)
    m, d = x.shape
    y = torch.empty_like(x)
    mean = torch.empty((m,), dtype=torch.float32, device=x.device) if store_stats else None
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device) if store_stats else None
    if m == 0:
        return y, mean, rstd
    ch = seg.chunks(seqlens, x.device, launch.fwd_rows)
    thirds = ln_thirds(d)
    block = d // 3 if thirds else next_power_of_2(d)
    bound(_adaln_mod_fwd_kernel)[(ch.n,)](
        x, shift, scale, ch.table, y, mean if store_stats else y, rstd if store_stats else y,
        ch.n, d, float(d), float(eps), x.stride(0), y.stride(0), _stride0(shift), _stride0(scale),
        STORE_STATS=store_stats, AHEAD=launch.fwd_ahead, STAGES=launch.fwd_stages, BLOCK_D=block, THIRDS=thirds,
        ONE_ROW=thirds and launch.fwd_rows == 1 and not launch.fwd_ahead and launch.fwd_stages is None,
        **launch_opts(num_warps_for(block), interpreting(), maxnreg=launch.fwd_maxnreg),
    )
    return y, mean, rstd


def adaln_modulation_bwd(dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                         seqlens: tuple[int, ...], need_vec: bool, config: LnConfig | None = None,
                         thirds: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Returns (dx (M, D), d_shift (B, D) | None, d_scale (B, D) | None), all in x's dtype; ``config`` as in
    :func:`adaln_modulation_fwd`. ``thirds`` (None: :func:`ln_thirds`) holds a row as three tiles: the row sums of
    dx take the forward's thirds tree; d_scale / d_shift keep their bytes (per-column chains) either way. The
    warps come from D alone (pow2(D)), thirds or not."""
    launch = _ln_config(config, x.dtype)
    m, d = x.shape
    thirds = ln_thirds(d) if thirds is None else thirds and ln_thirds(d)
    dx = torch.empty_like(x)
    ch = seg.chunks(seqlens, x.device)
    part = torch.empty((ch.n, 2 * d), dtype=torch.float32, device=x.device) if need_vec else None
    if m:
        block = d // 3 if thirds else next_power_of_2(d)
        bound(_adaln_mod_bwd_kernel)[(ch.n,)](
            x, scale, dy, mean, rstd, ch.table, dx, part if need_vec else dx,
            ch.n, d, float(d), x.stride(0), dy.stride(0), dx.stride(0), _stride0(scale), 2 * d,
            NEED_VEC=need_vec, AHEAD=launch.bwd_ahead, STAGES=launch.bwd_stages, BLOCK_D=block, THIRDS=thirds,
            **launch_opts(num_warps_for(next_power_of_2(d)), interpreting(), maxnreg=launch.bwd_maxnreg),
        )
    if not need_vec:
        return dx, None, None
    vec = seg.per_sample_sums(part, ch, x.dtype, interpreting())  # (B, 2D): [d_scale | d_shift]
    return dx, vec[:, d:], vec[:, :d]


class AdalnModulationFunction(torch.autograd.Function):
    """Autograd for :func:`adaln_modulation`: gradients of x, shift and scale."""

    @staticmethod
    def forward(ctx, x, shift, scale, seqlens, eps, config):  # type: ignore[override]
        ctx.config = config
        y, mean, rstd = adaln_modulation_fwd(x, shift, scale, seqlens, eps, store_stats=True, config=config)
        ctx.save_for_backward(x, scale, mean, rstd)
        ctx.seqlens = seqlens
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, scale, mean, rstd = ctx.saved_tensors
        need_vec = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        dx, dshift, dscale = adaln_modulation_bwd(dy.contiguous(), x, scale, mean, rstd, ctx.seqlens, need_vec,
                                                  config=ctx.config)
        return dx, dshift, dscale, None, None, None


def _wants_grad(*ts: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def adaln_modulation(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, *, seqlens: Sequence[int], eps: float,
                     config: LnConfig | None = None) -> torch.Tensor:
    """``LayerNorm(x)·(1 + scale[s]) + shift[s]``: x (M, D) fp32|bf16, shift/scale (B, D) same dtype → (M, D).

    Row-local forward (FP32, one cast); d_shift/d_scale per sample on the fixed tree of :mod:`.segments`.
    ``config``: a launch other than the frozen one (benchmarks only)."""
    op = "adaln_modulation"
    check_rows(op, "x", x)
    seq = check_seqlens(op, seqlens, x.shape[0])
    check_vectors(op, "shift", shift, x, len(seq))
    check_vectors(op, "scale", scale, x, len(seq))
    if _wants_grad(x, shift, scale):
        return AdalnModulationFunction.apply(x, shift, scale, seq, float(eps), config)
    return adaln_modulation_fwd(x, shift, scale, seq, float(eps), store_stats=False, config=config)[0]


def gate_residual_fwd(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, seqlens: tuple[int, ...]) -> torch.Tensor:
    """x, y (M, D), gate (B, D) → x + gate[s]·y (M, D)."""
    m, d = x.shape
    out = torch.empty_like(x)
    if m == 0:
        return out
    ch = seg.chunks(seqlens, x.device, FWD_ROWS)
    block = next_power_of_2(d)
    bound(_gate_residual_fwd_kernel)[(ch.n,)](
        x, y, gate, ch.table, out, ch.n, d, x.stride(0), y.stride(0), _stride0(gate), out.stride(0),
        BLOCK_D=block, **launch_opts(num_warps_for(block), interpreting()),
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
    block = min(next_power_of_2(d), cols or GATE_BWD_COLS)
    dy = torch.empty_like(y) if need_dy else None
    ch = seg.chunks(seqlens, y.device, chunk_rows or seg.CHUNK_ROWS)
    part = torch.empty((ch.n, d), dtype=torch.float32, device=y.device) if need_gate else None
    if m and (need_dy or need_gate):
        bound(_gate_residual_bwd_kernel)[(ch.n, cdiv(d, block))](
            dout, y, gate, ch.table, dy if need_dy else dout, part if need_gate else dout,
            ch.n, d, dout.stride(0), y.stride(0), _stride0(gate), y.stride(0), d,
            NEED_DY=need_dy, NEED_VEC=need_gate, BLOCK_D=block,
            **launch_opts(num_warps_for(block), interpreting()),
        )
    dgate = seg.per_sample_sums(part, ch, y.dtype, interpreting()) if need_gate else None
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
                    seqlens: Sequence[int], eps: float, lora: tuple | None = None,
                    config: LnConfig | None = None) -> torch.Tensor:
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
    return adaln_modulation(x, mod[:, d:], mod[:, :d], seqlens=seq, eps=eps, config=config)


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
_CONFIG = {"ln_launch": {str(dt).replace("torch.", ""): launch.label() for dt, launch in LN_CONFIGS.items()},
           "gate_fwd_rows_per_program": FWD_ROWS, "gate_bwd_columns_per_program": GATE_BWD_COLS,
           "chunk_rows": seg.CHUNK_ROWS, "fold_tile": seg.FOLD_TILE,
           "warps": "4 if pow2(D) <= 1024, 8 if <= 4096, else 16", "fp_fusion": False}
_SOURCE = (sys.modules[__name__], norms_kernels)
_DT = frozenset(DTYPES)
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

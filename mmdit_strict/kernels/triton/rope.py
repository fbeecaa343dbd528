"""CUDA strict QK preprocessing (Triton): per-head RMSNorm with a learned gain, multi-axis RoPE, and both fused.

Operators (docs/operators.md):

* ``qk_rmsnorm(x (M, H, d), gain (d,), *, seqlens, eps)`` → ``(x·rstd)·gain`` per (token, head),
  ``rstd = 1 ⊘ √(Σ_d x² ⊘ d + eps)``;
* ``multi_axis_rope(x (M, H, d), cos (M, d/2), sin (M, d/2))`` → interleaved pairs ``(x[2i], x[2i+1])``
  rotated: ``(x₀c − x₁s, x₀s + x₁c)``;
* ``qk_rmsnorm_rope(x, gain, cos, sin, *, seqlens, eps)``: both in one pass, **byte-equal to**
  ``multi_axis_rope(qk_rmsnorm(x, gain, ...), cos, sin)`` forward and backward.

Layout: a token's heads are one ``(H, d)`` tile read with 16-byte vector loads and stores; the rotation pairs
are formed in registers (``tl.reshape`` to ``(H, d/2, 2)`` + ``tl.split``, rotated, ``tl.join`` back). ONE
forward kernel (:func:`.rope_kernels._qk_fwd_kernel`: norm, rotation by θ or −θ, both) and ONE backward kernel
(:func:`.rope_kernels._qk_bwd_chunk_kernel`: the norm's, with or without the rotation back first) serve every
operator; the operator is chosen by runtime flags that Triton does not specialize on, so ``qk_rmsnorm`` and the
fused op run the same compiled binary (one register layout, one tree for every ``tl.sum``). Why this matters:
a ``tl.sum``'s tree is the register layout of its operand, which Triton chooses per compiled kernel; a
kernel that loads extra data (the rotation tables) could get another layout for the same sum, hence other
bytes. Inputs whose storage is not 16-byte aligned are copied first (a misaligned pointer would compile
another binary); RoPE tables are read as FP32 (a bf16 table is widened exactly).

Arithmetic (FP32, one IEEE rounding per operation as written; ``enable_fp_fusion=False``):

* forward: ``ss`` per (token, head) = ``tl.sum(x·x)`` over the d lanes, a fixed tree for the compiled kernel
  depending on H and d only; ``rstd = 1 ⊘ √(ss ⊘ d + eps)`` with ``div_rn``/``sqrt_rn``; ``y = (x·rstd)·gain``;
  rotation ``(y_e·c − y_o·s, y_e·s + y_o·c)``. ``rstd`` (M, H) FP32 is saved for backward.
* backward: rotation by −θ (the forward rotation with ``s·(−1)``); ``g = dy·gain``, ``x̂ = x·rstd``,
  ``dx = (g − x̂·(Σ g·x̂ ⊘ d))·rstd``; ``d_gain = Σ_rows Σ_heads dy·x̂`` in the per-sample chunks of
  :mod:`.segments`: per (head, lane) the chunk's tokens chained, then one ``tl.sum`` over heads per chunk,
  samples folded left in sample order.

Cast points. The unfused pair stores ``qk_rmsnorm``'s output in the storage dtype (its declared output)
and RoPE reads it back; its backward stores RoPE's input gradient in the storage dtype and the norm's
backward reads it back. The fused kernels round at exactly those two places (``y.to(dtype).to(fp32)``
before the rotation, the rotated gradient likewise before the norm backward) — in FP32 both are
identities — so fused and unfused give the same bytes in both dtypes, and the fused path saves the
intermediate's global-memory round trip, not a rounding.

Launch configuration: :data:`QK_FWD_CONFIGS` / :data:`QK_BWD_CONFIGS`, read-only tables of
:class:`QkFwdConfig` / :class:`QkBwdConfig` keyed by ``(dtype, one_head)`` (``one_head``: H == 1, txt_in's
RMSNorm of whole rows). No entry changes the arithmetic (same tile, same layout, same trees); none is chosen
from the number of tokens. A benchmark passes another configuration as the ``config=`` argument of
:func:`qk_norm_fwd` / :func:`qk_norm_bwd` / :func:`rope_apply` (or ``fwd_config=`` / ``bwd_config=`` of the
public operators); nothing else selects one.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Sequence

import torch

from ..registry import KernelImpl, register
from . import rope_kernels
from .bound import bound, cdiv, next_power_of_2
from . import segments as seg
from .gemm import DTYPES, interpreting, check_dtype_device, launch_opts
from .rope_kernels import _qk_bwd_chunk_kernel, _qk_fwd_kernel
from .segments import check_seqlens

MAX_HEAD_WIDTH = 8192  # d


def stages_label(stages: int | None) -> str:
    """A launch label's stages part: ", stages S" for a pipelined loop, nothing otherwise."""
    return f", stages {stages}" if stages else ""


def check_stages(stages: object, ahead: int, what: str) -> None:
    """A pipelined loop's stages: None, or 2..8 with no register read-ahead (``ahead`` 0)."""
    if stages is not None and (not isinstance(stages, int) or not 2 <= stages <= 8 or ahead):
        raise ValueError(f"{what}: stages must be None or 2..8 with ahead 0, got stages {stages!r}, ahead {ahead}")


@dataclass(frozen=True)
class QkFwdConfig:
    """How :func:`.rope_kernels._qk_fwd_kernel` is launched: ``tokens`` per program (the forward has no cross-token
    sum: any grouping gives the same bytes) and, with more than one, ``stages`` (None, or 2..8: the token loop
    pipelined through shared memory); ``split_heads``: a token's H heads as two tiles of pow2 ≤ H and
    pow2(H − that) heads when they hold fewer lanes than one pow2(H) tile, on the warps of the smaller tile (each
    head's d lanes then sit in the same threads as in the one tile, so its Σ x² has the same tree)."""

    tokens: int = 1
    stages: int | None = None
    split_heads: bool = False

    def label(self) -> str:
        return f"tokens {self.tokens}" + stages_label(self.stages) + (", heads split" if self.split_heads else "")

    def check(self) -> QkFwdConfig:
        """Self, or ValueError for a launch the kernel cannot run."""
        if not 1 <= self.tokens <= 64:
            raise ValueError(f"expected a QkFwdConfig with 1..64 tokens per program, got {self!r}")
        check_stages(self.stages, 0, "QkFwdConfig")
        return self


@dataclass(frozen=True)
class QkBwdConfig:
    """How :func:`.rope_kernels._qk_bwd_chunk_kernel` is launched; none of it touches the arithmetic. ahead:
    tokens read ahead into registers (1..3, or 0 with stages); maxnreg: a register cap for ptxas (None = none);
    stages: None, or 2..8 = the token loop software-pipelined by Triton (``tl.range(num_stages=)``: the next
    tokens' loads through shared memory, into the same register layout)."""

    ahead: int = 1
    maxnreg: int | None = None
    stages: int | None = None

    def label(self) -> str:
        return f"ahead {self.ahead}, maxnreg {self.maxnreg or '-'}" + stages_label(self.stages)

    def check(self) -> QkBwdConfig:
        """Self, or ValueError for a launch the kernel cannot run."""
        if self.ahead not in (0, 1, 2, 3) or (self.ahead == 0 and not self.stages):
            raise ValueError(f"expected a QkBwdConfig with ahead 1, 2 or 3, or ahead 0 with stages, got {self!r}")
        check_stages(self.stages, self.ahead, "QkBwdConfig")
        return self


# Keyed by (dtype, one_head): the one head of txt_in's RMSNorm (3584 lanes) runs unsplit and unpipelined.
# Measurements: experiments/norms/.
QK_FWD_CONFIGS: Mapping[tuple[torch.dtype, bool], QkFwdConfig] = MappingProxyType({
    (torch.bfloat16, False): QkFwdConfig(split_heads=True),
    (torch.bfloat16, True): QkFwdConfig(),
    (torch.float32, False): QkFwdConfig(split_heads=True),
    (torch.float32, True): QkFwdConfig(),
})
QK_BWD_CONFIGS: Mapping[tuple[torch.dtype, bool], QkBwdConfig] = MappingProxyType({
    (torch.bfloat16, False): QkBwdConfig(ahead=1),
    (torch.bfloat16, True): QkBwdConfig(ahead=1),
    (torch.float32, False): QkBwdConfig(ahead=0, stages=3),
    (torch.float32, True): QkBwdConfig(ahead=1),
})


def qk_fwd_config(dtype: torch.dtype, heads: int) -> QkFwdConfig:
    """The frozen forward launch for ``dtype`` and ``heads`` per token."""
    return QK_FWD_CONFIGS[dtype, heads == 1]


def qk_bwd_config(dtype: torch.dtype, heads: int) -> QkBwdConfig:
    """The frozen backward launch for ``dtype`` and ``heads`` per token."""
    return QK_BWD_CONFIGS[dtype, heads == 1]


def _fwd_config(config: object) -> QkFwdConfig:
    if not isinstance(config, QkFwdConfig):
        raise ValueError(f"expected a QkFwdConfig, got {config!r}")
    return config.check()


def _bwd_config(config: object) -> QkBwdConfig:
    if not isinstance(config, QkBwdConfig):
        raise ValueError(f"expected a QkBwdConfig, got {config!r}")
    return config.check()


def num_warps_for(elems: int) -> int:
    """Warps per program from the padded tile size (never from M): 4 up to 1024, 8 up to 4096, else 16."""
    return 4 if elems <= 1024 else 8 if elems <= 4096 else 16


def _opts(elems: int, maxnreg: int | None = None) -> dict:
    return launch_opts(num_warps_for(elems), interpreting(), maxnreg=maxnreg)


# ----------------------------------------------------------------------------------------------
# Host functions
# ----------------------------------------------------------------------------------------------


def check_heads(op: str, x: object) -> torch.Tensor:
    """x (M, H, d): fp32|bf16, even d, contiguous, on CUDA (CPU only under TRITON_INTERPRET=1)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"{op}: expected x of shape (M, H, d), got {getattr(x, 'shape', type(x).__name__)}")
    check_dtype_device(op, "x", x, interpreting())
    m, h, d = x.shape
    if h < 1 or d < 2 or d % 2 or d > MAX_HEAD_WIDTH:
        raise ValueError(f"{op}: expected H >= 1 and an even head width 2..{MAX_HEAD_WIDTH}, got x of shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{op}: expected x to be contiguous, got strides {tuple(x.stride())}")
    return x


def check_gain(op: str, gain: object, x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    if not isinstance(gain, torch.Tensor) or tuple(gain.shape) != (d,):
        raise ValueError(f"{op}: expected gain of shape ({d},), got {getattr(gain, 'shape', type(gain).__name__)}")
    if gain.dtype != x.dtype or gain.device != x.device or not gain.is_contiguous():
        raise ValueError(f"{op}: expected a contiguous gain of dtype {x.dtype} on {x.device}, got {gain.dtype} on {gain.device}")
    return gain


def check_tables(op: str, cos: object, sin: object, x: torch.Tensor) -> None:
    m, _, d = x.shape
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (m, d // 2):
            raise ValueError(f"{op}: expected {name} of shape ({m}, {d // 2}), got {getattr(t, 'shape', type(t).__name__)}")
        if t.dtype not in (torch.float32, x.dtype) or t.device != x.device or not t.is_contiguous():
            raise ValueError(f"{op}: expected a contiguous {name} table of dtype float32 (or {x.dtype}) on {x.device}, "
                             f"got {t.dtype} on {t.device}")


def _contig_blocks(h: int, d: int) -> tuple[int, int]:
    return next_power_of_2(h), max(2, next_power_of_2(d))


def head_tiles(h: int, split: bool) -> tuple[int, int]:
    """Heads per tile of the QK forward, (first, second): one pow2(h) tile (second 0), or with ``split`` the
    largest power of two <= h and pow2 of the rest when those hold fewer heads (24 -> (16, 8); 28 -> (32, 0))."""
    one = next_power_of_2(h)
    if split:
        a = 1 << (h.bit_length() - 1)
        b = next_power_of_2(h - a) if h > a else 0
        if b and a + b < one:
            return a, b
    return one, 0


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its storage starts on a 16-byte boundary, else an aligned copy: Triton compiles a
    separate binary for a misaligned pointer, and one binary per call pattern is what keeps the trees fixed."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _f32(t: torch.Tensor) -> torch.Tensor:
    """A RoPE table as aligned FP32 (exact from bf16): the kernels' table pointers are always FP32, so the
    norm alone and the fused op compile to the same binary."""
    return _aligned(t if t.dtype == torch.float32 else t.float())


def _contig_fwd(x: torch.Tensor, gain: torch.Tensor | None, cos: torch.Tensor | None, sin: torch.Tensor | None,
                eps: float, rstd: torch.Tensor | None, sign: float, config: QkFwdConfig | None = None) -> torch.Tensor:
    """One launch of :func:`.rope_kernels._qk_fwd_kernel` (flags from which of gain / cos / rstd are given);
    ``config`` defaults to the frozen one of (dtype, heads)."""
    m, h, d = x.shape
    config = _fwd_config(config) if config is not None else qk_fwd_config(x.dtype, h)
    x = _aligned(x)
    y = torch.empty_like(x)
    norm, rope = gain is not None, cos is not None
    dummy = torch.empty(1, dtype=torch.float32, device=x.device)
    _, bd = _contig_blocks(h, d)
    bh, bh2 = head_tiles(h, config.split_heads)
    warps = num_warps_for((bh2 or bh) * bd)  # a split runs on the smaller tile's warps
    bound(_qk_fwd_kernel)[(cdiv(m, config.tokens),)](
        x, _aligned(gain) if norm else x, _f32(cos) if rope else dummy, _f32(sin) if rope else dummy, y,
        rstd if rstd is not None else dummy,
        m, h, d, float(d), float(eps), float(sign), h * d, h * d, d // 2,
        int(norm), int(rope), int(rstd is not None),
        TOKENS=config.tokens, STAGES=config.stages, BLOCK_H=bh, BLOCK_H2=bh2, BLOCK_D=bd,
        **launch_opts(warps, interpreting()),
    )
    return y


def qk_norm_fwd(x: torch.Tensor, gain: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, eps: float,
                store_rstd: bool, config: QkFwdConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (M, H, d) → (y (M, H, d) x's dtype, rstd (M, H) fp32 | None); rotated when cos/sin are given.
    ``config``: the launch (default: :data:`QK_FWD_CONFIGS`)."""
    m, h, d = x.shape
    rstd = torch.empty((m, h), dtype=torch.float32, device=x.device) if store_rstd else None
    if not m:
        return torch.empty_like(x), rstd
    return _contig_fwd(x, gain, cos, sin, eps, rstd, 1.0, config), rstd


def qk_norm_bwd(dy: torch.Tensor, x: torch.Tensor, gain: torch.Tensor, rstd: torch.Tensor, cos: torch.Tensor | None,
                sin: torch.Tensor | None, seqlens: tuple[int, ...], need_gain: bool,
                config: QkBwdConfig | None = None, chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (dx (M, H, d), d_gain (d,) | None) in x's dtype. ``config``: the launch (default:
    :data:`QK_BWD_CONFIGS`). ``chunk_rows`` (None: segments.CHUNK_ROWS) is the d_gain tree's chunk length
    (another length, other d_gain bytes: probes only)."""
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"qk_norm_bwd: chunk_rows must be >= 1, got {chunk_rows}")
    m, h, d = x.shape
    config = _bwd_config(config) if config is not None else qk_bwd_config(x.dtype, h)
    dx = torch.empty_like(x)
    ch = seg.chunks(seqlens, x.device, chunk_rows or seg.CHUNK_ROWS)
    part = torch.empty((ch.n, d), dtype=torch.float32, device=x.device) if need_gain else None
    rope = cos is not None
    if m:
        bh, bd = _contig_blocks(h, d)
        dummy = torch.empty(1, dtype=torch.float32, device=x.device)
        bound(_qk_bwd_chunk_kernel)[(ch.n,)](
            _aligned(x), _aligned(gain), _f32(cos) if rope else dummy, _f32(sin) if rope else dummy, _aligned(dy), rstd, ch.table,
            dx, part if need_gain else dummy,
            ch.n, h, d, float(d), h * d, h * d, h * d, d // 2, d,
            int(rope), int(need_gain),
            AHEAD=config.ahead, STAGES=config.stages, BLOCK_H=bh, BLOCK_D=bd, **_opts(bh * bd, config.maxnreg),
        )
    dgain = seg.total_sum(part, ch, gain.dtype, interpreting()) if need_gain else None
    return dx, dgain


def rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool,
               config: QkFwdConfig | None = None) -> torch.Tensor:
    """x (M, H, d) rotated by the tables (by −θ when ``inverse``) → (M, H, d) in x's dtype; ``config`` as in
    :func:`qk_norm_fwd`."""
    if not x.shape[0]:
        return torch.empty_like(x)
    return _contig_fwd(x, None, cos, sin, 0.0, None, -1.0 if inverse else 1.0, config)


class QkNormFunction(torch.autograd.Function):
    """Autograd for :func:`qk_rmsnorm` (``cos is None``) and :func:`qk_rmsnorm_rope`: gradients of x and gain."""

    @staticmethod
    def forward(ctx, x, gain, cos, sin, seqlens, eps, fwd_config, bwd_config):  # type: ignore[override]
        y, rstd = qk_norm_fwd(x, gain, cos, sin, eps, store_rstd=True, config=fwd_config)
        ctx.save_for_backward(x, gain, rstd, cos, sin)
        ctx.seqlens = seqlens
        ctx.config = bwd_config
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, gain, rstd, cos, sin = ctx.saved_tensors
        dx, dgain = qk_norm_bwd(dy.contiguous(), x, gain, rstd, cos, sin, ctx.seqlens, ctx.needs_input_grad[1],
                                 config=ctx.config)
        return dx, dgain, None, None, None, None, None, None


class RopeFunction(torch.autograd.Function):
    """Autograd for :func:`multi_axis_rope`: dx is the rotation by −θ; the tables get no gradient."""

    @staticmethod
    def forward(ctx, x, cos, sin, config):  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        ctx.config = config
        return rope_apply(x, cos, sin, inverse=False, config=config)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return rope_apply(dy.contiguous(), cos, sin, inverse=True, config=ctx.config), None, None, None


def _wants_grad(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def qk_rmsnorm(x: torch.Tensor, gain: torch.Tensor, *, seqlens: Sequence[int], eps: float,
               fwd_config: QkFwdConfig | None = None, bwd_config: QkBwdConfig | None = None) -> torch.Tensor:
    """Per-head RMSNorm with a learned gain: x (M, H, d) fp32|bf16, gain (d,) → (M, H, d), one cast.
    d_gain: per sample on the fixed tree of :mod:`.segments`, samples folded left in order. ``fwd_config`` /
    ``bwd_config``: launches other than the frozen ones (benchmarks only)."""
    op = "qk_rmsnorm"
    check_heads(op, x)
    check_gain(op, gain, x)
    seq = check_seqlens(op, seqlens, x.shape[0])
    if _wants_grad(x, gain):
        return QkNormFunction.apply(x, gain, None, None, seq, float(eps), fwd_config, bwd_config)
    return qk_norm_fwd(x, gain, None, None, float(eps), store_rstd=False, config=fwd_config)[0]


def multi_axis_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                    fwd_config: QkFwdConfig | None = None) -> torch.Tensor:
    """Rotate interleaved pairs: x (M, H, d) fp32|bf16, cos/sin (M, d/2) (FP32 tables) → (M, H, d); two
    products and one add per output element in FP32, one cast. The backward runs the forward kernel by −θ."""
    op = "multi_axis_rope"
    check_heads(op, x)
    check_tables(op, cos, sin, x)
    if _wants_grad(x):
        return RopeFunction.apply(x, cos, sin, fwd_config)
    return rope_apply(x, cos, sin, inverse=False, config=fwd_config)


def qk_rmsnorm_rope(x: torch.Tensor, gain: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                    seqlens: Sequence[int], eps: float,
                    fwd_config: QkFwdConfig | None = None, bwd_config: QkBwdConfig | None = None) -> torch.Tensor:
    """Fused ``multi_axis_rope(qk_rmsnorm(x, gain), cos, sin)``: same bytes as the unfused pair (the
    intermediate is rounded to the storage dtype where the pair stores it), forward and backward."""
    op = "qk_rmsnorm_rope"
    check_heads(op, x)
    check_gain(op, gain, x)
    check_tables(op, cos, sin, x)
    seq = check_seqlens(op, seqlens, x.shape[0])
    if _wants_grad(x, gain):
        return QkNormFunction.apply(x, gain, cos, sin, seq, float(eps), fwd_config, bwd_config)
    return qk_norm_fwd(x, gain, cos, sin, float(eps), store_rstd=False, config=fwd_config)[0]


def rms_norm_rows(x: torch.Tensor, gain: torch.Tensor, *, seqlens: tuple[int, ...], eps: float) -> torch.Tensor:
    """RMSNorm of whole rows with a gain: x (M, C), gain (C,) → (M, C); :func:`qk_rmsnorm` with one head
    of width C (C even)."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"rms_norm_rows: expected x of shape (M, C) with even C, got {tuple(x.shape)}")
    return qk_rmsnorm(x.view(x.shape[0], 1, x.shape[1]), gain, seqlens=seqlens, eps=eps).view(x.shape)


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------

def _launch_labels(table: Mapping) -> dict[str, str]:
    """A per-(dtype, one head) launch table as the registry config shows it: {"bfloat16[, one head]": label}."""
    return {f"{str(dt).replace('torch.', '')}{', one head' if one else ''}": launch.label()
            for (dt, one), launch in table.items()}


_SOURCE = (sys.modules[__name__], rope_kernels)
_DT = frozenset(DTYPES)
_CONFIG = {"programs": "one token per forward program; backward chunks of segments.CHUNK_ROWS tokens",
           "tiles": "(pow2(H), pow2(d)) contiguous heads; rotation pairs by reshape + split/join in registers",
           "warps": "from pow2(H)·pow2(d) only", "fp_fusion": False,
           "flags": "norm / rope / rstd / d_gain are runtime arguments (do_not_specialize): one binary per dtype and head shape",
           "chunk_rows": seg.CHUNK_ROWS, "fold_tile": seg.FOLD_TILE,
           "qk_bwd_launch": _launch_labels(QK_BWD_CONFIGS), "qk_fwd_launch": _launch_labels(QK_FWD_CONFIGS)}
_FOLD = (f"chunk partials summed {seg.FOLD_TILE} per tl.sum tile, tiles chained, samples folded left in order; FP32")
_CHUNKS = f"in {seg.CHUNK_ROWS}-token chunks from the sample's first token"
REDUCTION_ORDER = (f"per (token, head): tl.sum over the d lanes of x², div_rn/sqrt_rn; d_gain: per (head, lane) tokens "
                   f"chained {_CHUNKS}, then tl.sum over heads once per chunk, {_FOLD}")

register(KernelImpl(
    op="qk_rmsnorm", backend="triton", device="cuda", dtypes=_DT, fn=qk_rmsnorm, strict=True, split_k=False,
    fusions={"multi_axis_rope": qk_rmsnorm_rope},
    kernel_name="_qk_fwd_kernel/_qk_bwd_chunk_kernel/_segment_fold_kernel", source=_SOURCE, config=dict(_CONFIG),
    reduction_order=REDUCTION_ORDER, accumulator="fp32",
))
register(KernelImpl(
    op="multi_axis_rope", backend="triton", device="cuda", dtypes=_DT, fn=multi_axis_rope, strict=True, split_k=False,
    kernel_name="_qk_fwd_kernel", source=_SOURCE, config=dict(_CONFIG),
    reduction_order="none (two products and one add per element, FP32, one cast)", accumulator="fp32",
))

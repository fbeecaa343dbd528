"""CUDA strict QK preprocessing (Triton): per-head RMSNorm with a learned gain, multi-axis RoPE, and both fused.

Operators (docs/operators.md):

* ``qk_rmsnorm(x (M, H, d), gain (d,), *, seqlens, eps)`` → ``(x·rstd)·gain`` per (token, head),
  ``rstd = 1 ⊘ √(Σ_d x² ⊘ d + eps)``;
* ``multi_axis_rope(x (M, H, d), cos (M, d/2), sin (M, d/2))`` → interleaved pairs ``(x[2i], x[2i+1])``
  rotated: ``(x₀c − x₁s, x₀s + x₁c)``;
* ``qk_rmsnorm_rope(x, gain, cos, sin, *, seqlens, eps)``: both in one pass, **byte-equal to**
  ``multi_axis_rope(qk_rmsnorm(x, gain, ...), cos, sin)`` forward and backward.

Layout (:data:`QK_LAYOUTS`, chosen with :func:`qk_layout`): ``"pairs"`` (the earlier default, still
selectable) reads a head as its even and odd lanes, two ``(H, d/2)`` tiles with stride-2 scalar accesses
(its own kernels per operator, a ``ROPE`` compile-time flag on the norm kernels). ``"contiguous"`` (the
default) reads a token's heads as one ``(H, d)`` tile with
16-byte vector loads and stores and forms the rotation pairs in registers (``tl.reshape`` to
``(H, d/2, 2)`` + ``tl.split``, rotated, ``tl.join`` back). It has ONE forward kernel
(:func:`_qk_fwd_kernel`: norm, rotation by θ or −θ, both) and ONE backward kernel (:func:`_qk_bwd_chunk_kernel`:
the norm's, with or without the rotation back first); the operator is chosen by runtime flags that Triton
does not specialize on, so ``qk_rmsnorm`` and the fused op run the same compiled binary (one register
layout, one tree for every ``tl.sum``) and share the arithmetic of the ``@triton.jit`` helpers
(:func:`_rms_rstd`, :func:`_pair_tables`, :func:`_rotate_pairs`, :func:`_rms_bwd`). Why this matters:
a ``tl.sum``'s tree is the register layout of its operand, which Triton chooses per compiled kernel; a
kernel that loads extra data (the rotation tables, a partner lane) can get another layout for the same
sum, hence other bytes. Inputs whose storage is not 16-byte aligned are copied first (a misaligned
pointer would compile another binary); RoPE tables are read as FP32 (a bf16 table is widened exactly).

Arithmetic (FP32, one IEEE rounding per operation as written; ``enable_fp_fusion=False``):

* forward: ``ss`` per (token, head) — pairs: ``tl.sum(x_e·x_e + x_o·x_o)`` over the d/2 pairs; contiguous:
  ``tl.sum(x·x)`` over the d lanes; each a fixed tree for the compiled kernel, depending on H and d only;
  ``rstd = 1 ⊘ √(ss ⊘ d + eps)`` with ``div_rn``/``sqrt_rn``; ``y = (x·rstd)·gain``; rotation
  ``(y_e·c − y_o·s, y_e·s + y_o·c)``. ``rstd`` (M, H) FP32 is saved for backward.
* backward: rotation by −θ ``(d_e·c + d_o·s, d_o·c − d_e·s)`` (contiguous: the forward rotation with
  ``s·(−1)``, the same values); ``g = dy·gain``, ``x̂ = x·rstd``,
  ``dx = (g − x̂·(Σ g·x̂ ⊘ d))·rstd``; ``d_gain = Σ_rows Σ_heads dy·x̂`` in the per-sample chunks of
  :mod:`.segments` — contiguous (``"chunk_heads"``): per (head, lane) the chunk's tokens chained, then one
  ``tl.sum`` over heads per chunk; pairs: per token a ``tl.sum`` over heads, tokens chained — samples folded
  left in sample order.

Cast points. The unfused pair stores ``qk_rmsnorm``'s output in the storage dtype (its declared output)
and RoPE reads it back; its backward stores RoPE's input gradient in the storage dtype and the norm's
backward reads it back. The fused kernels round at exactly those two places (``y.to(dtype).to(fp32)``
before the rotation, the rotated gradient likewise before the norm backward) — in FP32 both are
identities — so fused and unfused give the same bytes in both dtypes, and the fused path saves the
intermediate's global-memory round trip, not a rounding.

The RoPE tables are constants (no gradient); they may be FP32 (the model's tables) or the execution
dtype, and are read in FP32.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from ..choice import KernelChoice, KernelSetting
from ..registry import KernelImpl, register
from . import segments as seg
from .gemm import _DTYPES, _interpreting, check_dtype_device, launch_opts
from .segments import check_seqlens

MAX_HEAD_WIDTH = 8192  # d (the even/odd tiles hold d/2 lanes)

# How the kernels hold a head: "contiguous" (the default since the H200 run at a4c97e7: one (H, d) tile,
# vector accesses, pairs formed in registers; one binary for the fused and the unfused path) or "pairs"
# (the earlier default: even and odd lanes as two (H, d/2) tiles, scalar accesses). Each layout has its own fixed trees, so switching changes bytes (a versioned change);
# fused == unfused within a layout. Select one for a block of code with :func:`qk_layout` (an autograd
# node keeps the layout its forward ran with).
QK_LAYOUTS = ("pairs", "contiguous")
_LAYOUT = KernelChoice("qk layout", QK_LAYOUTS, "contiguous")


def current_qk_layout() -> str:
    """The QK norm / RoPE layout in force (the innermost :func:`qk_layout`, else the default)."""
    return _LAYOUT.current()


def qk_layout(name: str) -> contextlib.AbstractContextManager[None]:
    """Run the QK norm / RoPE kernels inside the block with layout ``name`` (one of :data:`QK_LAYOUTS`)."""
    return _LAYOUT.use(name)


# The contiguous layout's backward (:func:`_qk_bwd_chunk_kernel`, identity "chunk_heads"): per (head, lane) the
# chunk's tokens chained, then ONE tl.sum over heads per chunk for d_gain, everything a token needs read ahead.
# It replaced the per-token head sum ("token_heads", removed after the H200 run at 6ab3b56: bwd 860 -> 1570 GB/s
# bf16 4096 tokens, same dx and forward bytes, d_gain on this other fixed tree; experiments/norms/6ab3b56).


def stages_label(stages: int | None) -> str:
    """A launch label's stages part: ", stages S" for a pipelined loop, nothing otherwise."""
    return f", stages {stages}" if stages else ""


def check_stages(stages: object, ahead: int, what: str) -> None:
    """A pipelined loop's stages: None, or 2..8 with no register read-ahead (``ahead`` 0)."""
    if stages is not None and (not isinstance(stages, int) or not 2 <= stages <= 8 or ahead):
        raise ValueError(f"{what}: stages must be None or 2..8 with ahead 0, got stages {stages!r}, ahead {ahead}")


@dataclass(frozen=True)
class QkBwdLaunch:
    """How :func:`_qk_bwd_chunk_kernel` is launched; none of it touches the arithmetic (same tile, same
    layout, same trees: GPU test ``test_gpu_qk_bwd_launch_bytes_equal_reference``), none is chosen from the
    number of tokens. ahead: tokens read ahead into registers (1..3, or 0 with stages); maxnreg: a register cap
    for ptxas (None = none); stages: None, or 2..8 = the token loop software-pipelined by Triton
    (``tl.range(num_stages=)``: the next tokens' loads through shared memory, into the same register layout)."""

    ahead: int = 3
    maxnreg: int | None = None
    stages: int | None = None

    def label(self) -> str:
        return f"ahead {self.ahead}, maxnreg {self.maxnreg or '-'}" + stages_label(self.stages)


QK_BWD_REFERENCE = QkBwdLaunch(ahead=3)  # as measured at 6ab3b56
# The defaults, per execution dtype and whether the tile holds one head (never per token count), picked from
# the H200 sweep at c893898 (experiments/norms/c893898; every candidate byte-equal to the reference): one token
# ahead (bf16: 127 registers, two programs per SM) — 24 × 128 bf16 0.0479 -> 0.0340 ms (4096 tokens),
# 0.0886 -> 0.0618 (6889); fp32 24 × 128 also capped at 128 registers (24 B spilled; two programs per SM):
# 0.0684 -> 0.0592. The one head of 3584 (txt_in's RMSNorm) in fp32 runs uncapped (0.0199 -> 0.0184 ms; the
# cap spills 88 B there and took 0.0238). fp32 24 × 128 since the H200 tune run at 801d99e (experiments/norms/801d99e):
# the token loop pipelined in 3 stages through shared memory (128 registers, no spill), norm 0.0594 -> 0.0516 ms,
# fused 0.0607 -> 0.0523 (0.61 -> 0.71 of copy); in bf16 the pipelined loops were 3 % faster for the norm and 5 %
# slower for the fused op (one token ahead stays); for one head 3 stages took 0.0211 ms vs 0.0183.
QK_BWD_DEFAULTS = {(torch.bfloat16, False): QkBwdLaunch(ahead=1), (torch.bfloat16, True): QkBwdLaunch(ahead=1),
                   (torch.float32, False): QkBwdLaunch(ahead=0, stages=3), (torch.float32, True): QkBwdLaunch(ahead=1)}
QK_BWD_CANDIDATES = tuple(dict.fromkeys([QK_BWD_REFERENCE, *QK_BWD_DEFAULTS.values(), QkBwdLaunch(1), QkBwdLaunch(2),
                                         QkBwdLaunch(1, 128),
                                         # the token loop pipelined through shared memory (H200 at 801d99e)
                                         QkBwdLaunch(0, None, 2), QkBwdLaunch(0, None, 3), QkBwdLaunch(0, 128, 4)]))


def _check_qk_bwd_launch(launch: object) -> None:
    if not isinstance(launch, QkBwdLaunch) or launch.ahead not in (0, 1, 2, 3) or (launch.ahead == 0 and not launch.stages):
        raise ValueError(f"expected a QkBwdLaunch with ahead 1, 2 or 3, or ahead 0 with stages, got {launch!r}")
    check_stages(launch.stages, launch.ahead, "QkBwdLaunch")


_QK_BWD_LAUNCH: KernelSetting[QkBwdLaunch | None] = KernelSetting("qk bwd launch", None, _check_qk_bwd_launch)


def current_qk_bwd_launch(dtype: torch.dtype, heads: int) -> QkBwdLaunch:
    """The QK backward launch in force for ``dtype`` and ``heads`` per token (the innermost
    :func:`qk_bwd_launch`, else :data:`QK_BWD_DEFAULTS`, keyed by the dtype and whether ``heads == 1``)."""
    return _QK_BWD_LAUNCH.get() or QK_BWD_DEFAULTS[dtype, heads == 1]


def qk_bwd_launch(launch: QkBwdLaunch) -> contextlib.AbstractContextManager[None]:
    """Launch the contiguous QK backward with ``launch`` inside the block, whatever the dtype (bench and
    tests). Context-local; the autograd node keeps the launch in force at its forward for its backward."""
    return _QK_BWD_LAUNCH.use(launch)


@dataclass(frozen=True)
class QkFwdLaunch:
    """How :func:`_qk_fwd_kernel` is launched: ``tokens`` per program (the forward has no cross-token sum: any
    grouping gives the same bytes) and, with more than one, ``stages`` (None, or 2..8: the token loop pipelined
    through shared memory, as :class:`QkBwdLaunch`); ``split_heads``: a token's H heads as two tiles of
    pow2 ≤ H and pow2(H − that) heads when they hold fewer lanes than one pow2(H) tile, on the warps of the
    smaller tile (each head's d lanes then sit in the same threads as in the one tile, so its Σ x² has the same
    tree: the GPU test compares the bytes). Never chosen from the number of tokens."""

    tokens: int = 1
    stages: int | None = None
    split_heads: bool = False  #: a token's heads as two power-of-two tiles where that masks fewer lanes (24 = 16 + 8)

    def label(self) -> str:
        return f"tokens {self.tokens}" + stages_label(self.stages) + (", heads split" if self.split_heads else "")


QK_FWD_REFERENCE = QkFwdLaunch()  # one token per program: the forward as measured at c893898
# Grouping 4-16 tokens per program with a pipelined loop was slower in every case but the norm alone in bf16 (H200
# tune at 801d99e: fused bf16 4096 0.0183 -> 0.0203 ms at best; txt_in's one head 0.0023 -> 0.0044).
# 24 heads as 16 + 8 (H200 at 2762c3a, experiments/norms/2762c3a_split: every output and gradient byte-equal to the
# one-tile launch, accuracy and invariance pass): fused forward bf16 0.0186 -> 0.0177 ms (4096 tokens), 0.0298 ->
# 0.0283 (6889), fp32 0.0295 -> 0.0286; RoPE alone 0.0169 -> 0.0154; the norm alone 1 % slower (0.0145 -> 0.0147).
# The default for multi-head tiles: the model runs the fused operator, and one binary serves all three.
QK_FWD_SPLIT = QkFwdLaunch(split_heads=True)
QK_FWD_DEFAULTS = {(dt, one): QK_FWD_REFERENCE if one else QK_FWD_SPLIT for dt in (torch.bfloat16, torch.float32)
                   for one in (False, True)}
QK_FWD_CANDIDATES = tuple(dict.fromkeys([QK_FWD_REFERENCE, *QK_FWD_DEFAULTS.values(), QkFwdLaunch(4, 2),
                                         QkFwdLaunch(8, 3), QkFwdLaunch(16, 3), QkFwdLaunch(16, 4),
                                         QK_FWD_SPLIT, QkFwdLaunch(4, 2, split_heads=True),
                                         QkFwdLaunch(8, 3, split_heads=True)]))


def _check_qk_fwd_launch(launch: object) -> None:
    if not isinstance(launch, QkFwdLaunch) or not 1 <= launch.tokens <= 64:
        raise ValueError(f"expected a QkFwdLaunch with 1..64 tokens per program, got {launch!r}")
    check_stages(launch.stages, 0, "QkFwdLaunch")


_QK_FWD_LAUNCH: KernelSetting[QkFwdLaunch | None] = KernelSetting("qk fwd launch", None, _check_qk_fwd_launch)


def current_qk_fwd_launch(dtype: torch.dtype, heads: int) -> QkFwdLaunch:
    """The QK forward launch in force for ``dtype`` and ``heads`` per token (the innermost
    :func:`qk_fwd_launch`, else :data:`QK_FWD_DEFAULTS`)."""
    return _QK_FWD_LAUNCH.get() or QK_FWD_DEFAULTS[dtype, heads == 1]


def qk_fwd_launch(launch: QkFwdLaunch) -> contextlib.AbstractContextManager[None]:
    """Launch the contiguous QK forward (norm, RoPE, fused, txt_in's RMSNorm) with ``launch`` inside the block."""
    return _QK_FWD_LAUNCH.use(launch)


def num_warps_for(elems: int) -> int:
    """Warps per program from the padded tile size (never from M): 4 up to 1024, 8 up to 4096, else 16."""
    return 4 if elems <= 1024 else 8 if elems <= 4096 else 16


def _opts(elems: int, maxnreg: int | None = None) -> dict:
    return launch_opts(num_warps_for(elems), _interpreting(), maxnreg=maxnreg)


def _blocks(h: int, d: int) -> tuple[int, int]:
    return max(2, triton.next_power_of_2(h)), max(2, triton.next_power_of_2(d // 2))


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _head_tile(H, W, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr):
    """A token's (BLOCK_H, BLOCK_W) tile of H heads × W lanes: (offs_h, offs_w, mask_h, mask_w, mask)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_w = tl.arange(0, BLOCK_W)
    mask_h = offs_h < H
    mask_w = offs_w < W
    return offs_h, offs_w, mask_h, mask_w, mask_h[:, None] & mask_w[None, :]


@triton.jit
def _qk_norm_fwd_kernel(
    x_ptr, gain_ptr, cos_ptr, sin_ptr, y_ptr, rstd_ptr,
    H, P, d_float, eps, stride_x, stride_y, stride_cs,
    ROPE: tl.constexpr, STORE_RSTD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """One token: per head rstd, y = (x·rstd)·gain; with ROPE, y rounded to the storage dtype and
    rotated. One cast at the store."""
    row = tl.program_id(0).to(tl.int64)
    offs_h, offs_p, mask_h, mask_p, mask = _head_tile(H, P, BLOCK_H, BLOCK_P)
    even = offs_h[:, None] * (2 * P) + 2 * offs_p[None, :]
    g_e = tl.load(gain_ptr + 2 * offs_p, mask=mask_p, other=0.0).to(tl.float32)
    g_o = tl.load(gain_ptr + 2 * offs_p + 1, mask=mask_p, other=0.0).to(tl.float32)
    x_e = tl.load(x_ptr + row * stride_x + even, mask=mask, other=0.0).to(tl.float32)
    x_o = tl.load(x_ptr + row * stride_x + even + 1, mask=mask, other=0.0).to(tl.float32)
    ss = tl.sum(x_e * x_e + x_o * x_o, axis=1)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, d_float) + eps))
    y_e = (x_e * rstd[:, None]) * g_e[None, :]
    y_o = (x_o * rstd[:, None]) * g_o[None, :]
    if ROPE:
        y_e = y_e.to(y_ptr.dtype.element_ty).to(tl.float32)  # the unfused pair's cast point
        y_o = y_o.to(y_ptr.dtype.element_ty).to(tl.float32)
        c = tl.load(cos_ptr + row * stride_cs + offs_p, mask=mask_p, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + row * stride_cs + offs_p, mask=mask_p, other=0.0).to(tl.float32)[None, :]
        r_e = y_e * c - y_o * s
        r_o = y_e * s + y_o * c
        y_e, y_o = r_e, r_o
    tl.store(y_ptr + row * stride_y + even, y_e.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + row * stride_y + even + 1, y_o.to(y_ptr.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(rstd_ptr + row * H + offs_h, rstd, mask=mask_h)


@triton.jit
def _qk_norm_bwd_kernel(
    x_ptr, gain_ptr, cos_ptr, sin_ptr, dy_ptr, rstd_ptr, table_ptr, dx_ptr, part_ptr,
    n_chunks, H, P, d_float, stride_x, stride_dy, stride_dx, stride_cs, stride_part,
    ROPE: tl.constexpr, NEED_GAIN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """One chunk of tokens of one sample: dx per token (with ROPE, the rotated-back gradient rounded to
    the storage dtype first), and part[c] = Σ_tokens (tl.sum over heads of dy·x̂) chained in token order."""
    c = tl.program_id(0)
    r0 = tl.load(table_ptr + c)
    r1 = tl.load(table_ptr + n_chunks + c)
    # The tile spelled out, not _head_tile: through the helper the sm_90 SASS of the bf16 1 × 3584 rope
    # backward changes (uniform registers swapped; same ops), so this kernel keeps its own lines.
    offs_h = tl.arange(0, BLOCK_H)
    offs_p = tl.arange(0, BLOCK_P)
    mask_h = offs_h < H
    mask_p = offs_p < P
    mask = mask_h[:, None] & mask_p[None, :]
    even = offs_h[:, None] * (2 * P) + 2 * offs_p[None, :]
    g_e = tl.load(gain_ptr + 2 * offs_p, mask=mask_p, other=0.0).to(tl.float32)[None, :]
    g_o = tl.load(gain_ptr + 2 * offs_p + 1, mask=mask_p, other=0.0).to(tl.float32)[None, :]
    p_e = tl.zeros((BLOCK_P,), dtype=tl.float32)
    p_o = tl.zeros((BLOCK_P,), dtype=tl.float32)
    row = r0.to(tl.int64)
    x_e = tl.load(x_ptr + row * stride_x + even, mask=mask, other=0.0)
    x_o = tl.load(x_ptr + row * stride_x + even + 1, mask=mask, other=0.0)
    d_e = tl.load(dy_ptr + row * stride_dy + even, mask=mask, other=0.0)
    d_o = tl.load(dy_ptr + row * stride_dy + even + 1, mask=mask, other=0.0)
    first = r0.to(tl.int64)
    for i in range(0, r1 - r0):
        row = first + i
        nxt = row + 1
        nmask = (offs_h < tl.where(nxt < r1, H, 0))[:, None] & mask_p[None, :]  # nothing past the chunk
        x_e_n = tl.load(x_ptr + nxt * stride_x + even, mask=nmask, other=0.0)
        x_o_n = tl.load(x_ptr + nxt * stride_x + even + 1, mask=nmask, other=0.0)
        d_e_n = tl.load(dy_ptr + nxt * stride_dy + even, mask=nmask, other=0.0)
        d_o_n = tl.load(dy_ptr + nxt * stride_dy + even + 1, mask=nmask, other=0.0)
        rstd = tl.load(rstd_ptr + row * H + offs_h, mask=mask_h, other=0.0)[:, None]
        dy_e = d_e.to(tl.float32)
        dy_o = d_o.to(tl.float32)
        if ROPE:
            cs = tl.load(cos_ptr + row * stride_cs + offs_p, mask=mask_p, other=0.0).to(tl.float32)[None, :]
            sn = tl.load(sin_ptr + row * stride_cs + offs_p, mask=mask_p, other=0.0).to(tl.float32)[None, :]
            u_e = dy_e * cs + dy_o * sn
            u_o = dy_o * cs - dy_e * sn
            dy_e = u_e.to(dx_ptr.dtype.element_ty).to(tl.float32)  # the unfused pair's cast point
            dy_o = u_o.to(dx_ptr.dtype.element_ty).to(tl.float32)
        xh_e = x_e.to(tl.float32) * rstd
        xh_o = x_o.to(tl.float32) * rstd
        gl_e = dy_e * g_e
        gl_o = dy_o * g_o
        c1 = tl.div_rn(tl.sum(gl_e * xh_e + gl_o * xh_o, axis=1), d_float)[:, None]
        dx_e = (gl_e - xh_e * c1) * rstd
        dx_o = (gl_o - xh_o * c1) * rstd
        tl.store(dx_ptr + row * stride_dx + even, dx_e.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + row * stride_dx + even + 1, dx_o.to(dx_ptr.dtype.element_ty), mask=mask)
        if NEED_GAIN:
            p_e = p_e + tl.sum(dy_e * xh_e, axis=0)
            p_o = p_o + tl.sum(dy_o * xh_o, axis=0)
        x_e, x_o, d_e, d_o = x_e_n, x_o_n, d_e_n, d_o_n
    if NEED_GAIN:
        base = part_ptr + c.to(tl.int64) * stride_part
        tl.store(base + 2 * offs_p, p_e, mask=mask_p)
        tl.store(base + 2 * offs_p + 1, p_o, mask=mask_p)


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, y_ptr,
    H, P, stride_x, stride_y, stride_cs,
    INVERSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """One token: (x_e·c − x_o·s, x_e·s + x_o·c); INVERSE (the backward): (x_e·c + x_o·s, x_o·c − x_e·s)."""
    row = tl.program_id(0).to(tl.int64)
    offs_h, offs_p, _, mask_p, mask = _head_tile(H, P, BLOCK_H, BLOCK_P)
    even = offs_h[:, None] * (2 * P) + 2 * offs_p[None, :]
    x_e = tl.load(x_ptr + row * stride_x + even, mask=mask, other=0.0).to(tl.float32)
    x_o = tl.load(x_ptr + row * stride_x + even + 1, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + row * stride_cs + offs_p, mask=mask_p, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + row * stride_cs + offs_p, mask=mask_p, other=0.0).to(tl.float32)[None, :]
    if INVERSE:
        r_e = x_e * c + x_o * s
        r_o = x_o * c - x_e * s
    else:
        r_e = x_e * c - x_o * s
        r_o = x_e * s + x_o * c
    tl.store(y_ptr + row * stride_y + even, r_e.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + row * stride_y + even + 1, r_o.to(y_ptr.dtype.element_ty), mask=mask)


# ---- the "contiguous" layout ------------------------------------------------------------------
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
    """The contiguous layout's backward (identity ``"chunk_heads"``): one chunk of tokens of one sample,
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


# ----------------------------------------------------------------------------------------------
# Host functions
# ----------------------------------------------------------------------------------------------


def check_heads(op: str, x: object) -> torch.Tensor:
    """x (M, H, d): fp32|bf16, even d, contiguous, on CUDA (CPU only under TRITON_INTERPRET=1)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"{op}: expected x of shape (M, H, d), got {getattr(x, 'shape', type(x).__name__)}")
    check_dtype_device(op, "x", x, _interpreting())
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
    return triton.next_power_of_2(h), max(2, triton.next_power_of_2(d))


def head_tiles(h: int, split: bool) -> tuple[int, int]:
    """Heads per tile of the QK forward, (first, second): one pow2(h) tile (second 0), or with ``split`` the
    largest power of two <= h and pow2 of the rest when those hold fewer heads (24 -> (16, 8); 28 -> (32, 0))."""
    one = triton.next_power_of_2(h)
    if split:
        a = 1 << (h.bit_length() - 1)
        b = triton.next_power_of_2(h - a) if h > a else 0
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
                eps: float, rstd: torch.Tensor | None, sign: float, launch: QkFwdLaunch | None = None) -> torch.Tensor:
    """One launch of :func:`_qk_fwd_kernel` (flags from which of gain / cos / rstd are given); ``launch``
    defaults to the one in force (:func:`qk_fwd_launch`)."""
    m, h, d = x.shape
    launch = launch or current_qk_fwd_launch(x.dtype, h)
    x = _aligned(x)
    y = torch.empty_like(x)
    norm, rope = gain is not None, cos is not None
    dummy = torch.empty(1, dtype=torch.float32, device=x.device)
    _, bd = _contig_blocks(h, d)
    bh, bh2 = head_tiles(h, launch.split_heads)
    warps = num_warps_for((bh2 or bh) * bd)  # a split runs on the smaller tile's warps
    _qk_fwd_kernel[(triton.cdiv(m, launch.tokens),)](
        x, _aligned(gain) if norm else x, _f32(cos) if rope else dummy, _f32(sin) if rope else dummy, y,
        rstd if rstd is not None else dummy,
        m, h, d, float(d), float(eps), float(sign), h * d, h * d, d // 2,
        int(norm), int(rope), int(rstd is not None),
        TOKENS=launch.tokens, STAGES=launch.stages, BLOCK_H=bh, BLOCK_H2=bh2, BLOCK_D=bd,
        **launch_opts(warps, _interpreting()),
    )
    return y


def qk_norm_fwd(x: torch.Tensor, gain: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, eps: float,
                store_rstd: bool, layout: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (M, H, d) → (y (M, H, d) x's dtype, rstd (M, H) fp32 | None); rotated when cos/sin are given."""
    m, h, d = x.shape
    rstd = torch.empty((m, h), dtype=torch.float32, device=x.device) if store_rstd else None
    rope = cos is not None
    if not m:
        return torch.empty_like(x), rstd
    if (layout or _LAYOUT.current()) == "contiguous":
        return _contig_fwd(x, gain, cos, sin, eps, rstd, 1.0), rstd
    y = torch.empty_like(x)
    bh, bp = _blocks(h, d)
    _qk_norm_fwd_kernel[(m,)](
        x, gain, cos if rope else x, sin if rope else x, y, rstd if store_rstd else y,
        h, d // 2, float(d), float(eps), h * d, h * d, d // 2 if rope else 0,
        ROPE=rope, STORE_RSTD=store_rstd, BLOCK_H=bh, BLOCK_P=bp, **_opts(bh * bp * 2),
    )
    return y, rstd


def qk_norm_bwd(dy: torch.Tensor, x: torch.Tensor, gain: torch.Tensor, rstd: torch.Tensor, cos: torch.Tensor | None,
                sin: torch.Tensor | None, seqlens: tuple[int, ...], need_gain: bool,
                layout: str | None = None, launch: QkBwdLaunch | None = None,
                chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (dx (M, H, d), d_gain (d,) | None) in x's dtype. ``layout`` defaults to the one in force
    (:func:`qk_layout`), ``launch`` (contiguous layout only) to :func:`qk_bwd_launch`'s. ``chunk_rows`` (None:
    segments.CHUNK_ROWS) is the d_gain tree's chunk length (another length, other d_gain bytes: probes only)."""
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"qk_norm_bwd: chunk_rows must be >= 1, got {chunk_rows}")
    m, h, d = x.shape
    layout = layout or _LAYOUT.current()
    launch = launch or current_qk_bwd_launch(x.dtype, h)
    dx = torch.empty_like(x)
    ch = seg.chunks(seqlens, x.device, chunk_rows or seg.CHUNK_ROWS)
    part = torch.empty((ch.n, d), dtype=torch.float32, device=x.device) if need_gain else None
    rope = cos is not None
    if m and layout == "contiguous":
        bh, bd = _contig_blocks(h, d)
        dummy = torch.empty(1, dtype=torch.float32, device=x.device)
        _qk_bwd_chunk_kernel[(ch.n,)](
            _aligned(x), _aligned(gain), _f32(cos) if rope else dummy, _f32(sin) if rope else dummy, _aligned(dy), rstd, ch.table,
            dx, part if need_gain else dummy,
            ch.n, h, d, float(d), h * d, h * d, h * d, d // 2, d,
            int(rope), int(need_gain),
            AHEAD=launch.ahead, STAGES=launch.stages, BLOCK_H=bh, BLOCK_D=bd, **_opts(bh * bd, launch.maxnreg),
        )
    elif m:
        bh, bp = _blocks(h, d)
        _qk_norm_bwd_kernel[(ch.n,)](
            x, gain, cos if rope else x, sin if rope else x, dy, rstd, ch.table, dx, part if need_gain else dx,
            ch.n, h, d // 2, float(d), h * d, h * d, h * d, d // 2 if rope else 0, d,
            ROPE=rope, NEED_GAIN=need_gain, BLOCK_H=bh, BLOCK_P=bp, **_opts(bh * bp * 2),
        )
    dgain = seg.total_sum(part, ch, gain.dtype, _interpreting()) if need_gain else None
    return dx, dgain


def rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool, layout: str | None = None) -> torch.Tensor:
    """x (M, H, d) rotated by the tables (by −θ when ``inverse``) → (M, H, d) in x's dtype."""
    m, h, d = x.shape
    if not m:
        return torch.empty_like(x)
    if (layout or _LAYOUT.current()) == "contiguous":
        return _contig_fwd(x, None, cos, sin, 0.0, None, -1.0 if inverse else 1.0)
    y = torch.empty_like(x)
    bh, bp = _blocks(h, d)
    _rope_kernel[(m,)](x, cos, sin, y, h, d // 2, h * d, h * d, d // 2,
                       INVERSE=inverse, BLOCK_H=bh, BLOCK_P=bp, **_opts(bh * bp * 2))
    return y


class QkNormFunction(torch.autograd.Function):
    """Autograd for :func:`qk_rmsnorm` (``cos is None``) and :func:`qk_rmsnorm_rope`: gradients of x and gain."""

    @staticmethod
    def forward(ctx, x, gain, cos, sin, seqlens, eps):  # type: ignore[override]
        ctx.layout = _LAYOUT.current()
        ctx.launch = current_qk_bwd_launch(x.dtype, x.shape[1])
        y, rstd = qk_norm_fwd(x, gain, cos, sin, eps, store_rstd=True, layout=ctx.layout)
        ctx.save_for_backward(x, gain, rstd, cos, sin)
        ctx.seqlens = seqlens
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, gain, rstd, cos, sin = ctx.saved_tensors
        dx, dgain = qk_norm_bwd(dy.contiguous(), x, gain, rstd, cos, sin, ctx.seqlens, ctx.needs_input_grad[1],
                                 layout=ctx.layout, launch=ctx.launch)
        return dx, dgain, None, None, None, None


class RopeFunction(torch.autograd.Function):
    """Autograd for :func:`multi_axis_rope`: dx is the rotation by −θ; the tables get no gradient."""

    @staticmethod
    def forward(ctx, x, cos, sin):  # type: ignore[override]
        ctx.layout = _LAYOUT.current()
        ctx.save_for_backward(cos, sin)
        return rope_apply(x, cos, sin, inverse=False, layout=ctx.layout)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return rope_apply(dy.contiguous(), cos, sin, inverse=True, layout=ctx.layout), None, None


def _wants_grad(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def qk_rmsnorm(x: torch.Tensor, gain: torch.Tensor, *, seqlens: Sequence[int], eps: float) -> torch.Tensor:
    """Per-head RMSNorm with a learned gain: x (M, H, d) fp32|bf16, gain (d,) → (M, H, d), one cast.
    d_gain: per sample on the fixed tree of :mod:`.segments`, samples folded left in order."""
    op = "qk_rmsnorm"
    check_heads(op, x)
    check_gain(op, gain, x)
    seq = check_seqlens(op, seqlens, x.shape[0])
    if _wants_grad(x, gain):
        return QkNormFunction.apply(x, gain, None, None, seq, float(eps))
    return qk_norm_fwd(x, gain, None, None, float(eps), store_rstd=False)[0]


def multi_axis_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs: x (M, H, d) fp32|bf16, cos/sin (M, d/2) (FP32 tables) → (M, H, d); two
    products and one add per output element in FP32, one cast."""
    op = "multi_axis_rope"
    check_heads(op, x)
    check_tables(op, cos, sin, x)
    if _wants_grad(x):
        return RopeFunction.apply(x, cos, sin)
    return rope_apply(x, cos, sin, inverse=False)


def qk_rmsnorm_rope(x: torch.Tensor, gain: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                    seqlens: Sequence[int], eps: float) -> torch.Tensor:
    """Fused ``multi_axis_rope(qk_rmsnorm(x, gain), cos, sin)``: same bytes as the unfused pair (the
    intermediate is rounded to the storage dtype where the pair stores it), forward and backward."""
    op = "qk_rmsnorm_rope"
    check_heads(op, x)
    check_gain(op, gain, x)
    check_tables(op, cos, sin, x)
    seq = check_seqlens(op, seqlens, x.shape[0])
    if _wants_grad(x, gain):
        return QkNormFunction.apply(x, gain, cos, sin, seq, float(eps))
    return qk_norm_fwd(x, gain, cos, sin, float(eps), store_rstd=False)[0]


def rms_norm_rows(x: torch.Tensor, gain: torch.Tensor, *, seqlens: tuple[int, ...], eps: float) -> torch.Tensor:
    """RMSNorm of whole rows with a gain: x (M, C), gain (C,) → (M, C); :func:`qk_rmsnorm` with one head
    of width C (C even)."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"rms_norm_rows: expected x of shape (M, C) with even C, got {tuple(x.shape)}")
    return qk_rmsnorm(x.view(x.shape[0], 1, x.shape[1]), gain, seqlens=seqlens, eps=eps).view(x.shape)


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------

def _launch_labels(defaults: dict) -> dict[str, str]:
    """A per-(dtype, one head) launch table as the registry config shows it: {"bfloat16[, one head]": label}."""
    return {f"{str(dt).replace('torch.', '')}{', one head' if one else ''}": launch.label()
            for (dt, one), launch in defaults.items()}


_SOURCE = sys.modules[__name__]
_DT = frozenset(_DTYPES)
_CONFIG = {"programs": "one token per forward program; backward chunks of segments.CHUNK_ROWS tokens",
           "tiles": "(pow2(H), pow2(d)) contiguous heads; rotation pairs by reshape + split/join in registers",
           "warps": "from pow2(H)·pow2(d) only", "fp_fusion": False,
           "flags": "norm / rope / rstd / d_gain are runtime arguments (do_not_specialize): one binary per dtype and head shape",
           "chunk_rows": seg.CHUNK_ROWS, "fold_tile": seg.FOLD_TILE,
           "qk_layout": "contiguous (the earlier 'pairs' layout runs only inside rope.qk_layout('pairs'))",
           "qk_bwd": "chunk_heads",
           "qk_bwd_launch": _launch_labels(QK_BWD_DEFAULTS), "qk_fwd_launch": _launch_labels(QK_FWD_DEFAULTS)}
_FOLD = (f"chunk partials summed {seg.FOLD_TILE} per tl.sum tile, tiles chained, samples folded left in order; FP32")
_CHUNKS = f"in {seg.CHUNK_ROWS}-token chunks from the sample's first token"
# layout → (backward variant, the kernels that run, their trees): the registry identity of each layout
_QK_VARIANTS = {
    "contiguous": ("chunk_heads",
        "_qk_fwd_kernel/_qk_bwd_chunk_kernel/_segment_fold_kernel",
        (f"per (token, head): tl.sum over the d lanes of x², div_rn/sqrt_rn; d_gain: per (head, lane) tokens chained "
         f"{_CHUNKS}, then tl.sum over heads once per chunk, {_FOLD}")),
    "pairs": ("token_heads",
        "_qk_norm_fwd_kernel/_qk_norm_bwd_kernel/_segment_fold_kernel",
        (f"per (token, head): x_e² + x_o² per pair, tl.sum over the d/2 pairs, div_rn/sqrt_rn; d_gain: even and odd "
         f"lanes each a tl.sum over heads per token, tokens chained {_CHUNKS}, {_FOLD}")),
}


def _qk_variant() -> dict:
    layout = _LAYOUT.current()
    bwd, kernel, order = _QK_VARIANTS[layout]
    return {"variant": f"{layout}/{bwd}", "kernel": kernel, "reduction_order": order}


def _rope_variant() -> dict:
    layout = _LAYOUT.current()
    return {"variant": layout, "kernel": "_qk_fwd_kernel" if layout == "contiguous" else "_rope_kernel"}


register(KernelImpl(
    op="qk_rmsnorm", backend="triton", device="cuda", dtypes=_DT, fn=qk_rmsnorm, strict=True, split_k=False,
    fusions={"multi_axis_rope": qk_rmsnorm_rope},
    kernel_name=_QK_VARIANTS["contiguous"][1], source=_SOURCE, config=dict(_CONFIG),
    reduction_order=_QK_VARIANTS["contiguous"][2], accumulator="fp32", variant=_qk_variant,
))
register(KernelImpl(
    op="multi_axis_rope", backend="triton", device="cuda", dtypes=_DT, fn=multi_axis_rope, strict=True, split_k=False,
    kernel_name="_qk_fwd_kernel", source=_SOURCE, config=dict(_CONFIG),
    reduction_order="none (two products and one add per element, FP32, one cast)", accumulator="fp32",
    variant=_rope_variant,
))

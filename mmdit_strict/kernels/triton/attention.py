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
* Configurations (tiles, warps, stages, how tiles are loaded) are frozen per ``(head_dim, dtype)`` in
  :data:`CONFIGS`, a read-only table of :class:`AttentionConfig`. A benchmark passes another configuration
  as the ``config=`` argument of :func:`joint_attention_fused` / :func:`attention_fwd` /
  :func:`attention_bwd`; nothing else selects one.

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

Modules: the forward kernel and the tile helpers in :mod:`.attention_fwd_kernels`, the backward kernels in
:mod:`.attention_bwd_kernels`, the warp-specialized (Gluon, sm_90) forward in :mod:`.attention_ws` and dK/dV kernel
in :mod:`.attention_bwd_ws`; this module holds the configuration table, the host launchers, the autograd function
and the registry entry.

Why a sample's bytes cannot depend on its batch: every tile, every loop bound and every mask is a
function of that sample's own text and image lengths; the configuration depends only on
``(head_dim, dtype)``; no program reads or writes another sample's rows.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Sequence

import torch
import triton

from ..checks import check_operand
from ..execution import current
from ..keepalive import retain
from ..registry import KernelImpl, register
from . import attention_bwd_kernels, attention_bwd_ws, attention_fwd_kernels, attention_ws
from .attention_bwd_kernels import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _bwd_delta_kernel
from .attention_fwd_kernels import _attn_fwd_kernel
from .bound import bound
from .gemm import DTYPES, interpreting, launch_opts

# ----------------------------------------------------------------------------------------------
# Configurations: frozen per (head_dim, dtype), never keyed by batch or token counts
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tiles:
    """One kernel's launch: ``block_m`` query rows and ``block_n`` key rows per tile, warps, pipeline stages.

    For the forward and dQ kernels a program owns ``block_m`` query rows and steps over ``block_n`` key rows;
    for the dK/dV kernel it owns ``block_n`` key rows and steps over ``block_m`` query rows. The step over the
    keys fixes the forward's and dQ's accumulation order (bytes); warps and stages do not."""

    block_m: int
    block_n: int
    warps: int
    stages: int


@dataclass(frozen=True)
class AttentionConfig:
    """The configuration of one ``(head_dim, dtype)``. Only the tiles change the arithmetic order; the flags
    choose how the same values reach the same operations (the same bytes, tested).

    Attributes:
        fwd, dkdv, dq: :class:`Tiles` of the forward, the dK/dV and the dQ kernel.
        delta_rows: rows per program of the Δ = rowsum(dO ∘ O) kernel.
        resident_direct: the resident tiles (Q; K/V in dK/dV; dO in dQ) are one load through the stream's base
            pointer chosen per program, instead of two masked loads merged with ``tl.where``.
        stat_base: the dK/dV kernel addresses LSE/Δ through scalar base pointers plus one loop-invariant
            offset vector, instead of a 64-bit offset vector advanced per tile.
        fwd_tma: the forward streams K/V through tensor descriptors spanning one segment (pointer loads
            where a base is not 16-byte aligned).
        fwd_ws: the forward runs the warp-specialized Gluon kernel (:mod:`.attention_ws`) where it can
            (sm_90, Gluon, aligned bases; it needs bf16, d = 128, 128 × 128 tiles, 2-3 stages, ``fwd_tma``);
            elsewhere the Triton forward with the same tiles.
        bwd_ws: the dK/dV kernel is the warp-specialized Gluon one (:mod:`.attention_bwd_ws`) where it can (sm_90,
            Gluon, aligned bases; it needs bf16, d = 128, 128 key rows a tile, 32 or 64 query rows a step, 2 stages
            or more, as many as shared memory holds); elsewhere the Triton dK/dV kernel with the same tiles.
    """

    fwd: Tiles
    dkdv: Tiles
    dq: Tiles
    delta_rows: int
    resident_direct: bool = False
    stat_base: bool = False
    fwd_tma: bool = False
    fwd_ws: bool = False
    bwd_ws: bool = False

    def replace(self, **changes: Any) -> AttentionConfig:
        """A copy with ``changes`` (benchmark candidates); a tile may be given as a 4-sequence."""
        for key in ("fwd", "dkdv", "dq"):
            if key in changes and not isinstance(changes[key], Tiles):
                changes[key] = Tiles(*changes[key])
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_SMALL = AttentionConfig(fwd=Tiles(16, 16, 4, 2), dkdv=Tiles(16, 16, 4, 2), dq=Tiles(16, 16, 4, 2), delta_rows=16)

# bf16 d = 128 (Qwen-Image): the 128 x 128 forward with TMA K/V loads through the warp-specialized kernel; the
# backward's FP32 accumulators take 8 warps (dK/dV: two warpgroups of the warp-specialized kernel, the Triton kernel's
# bytes). Measurements: experiments/attention/.
CONFIGS: Mapping[tuple[int, torch.dtype], AttentionConfig] = MappingProxyType({
    (128, torch.bfloat16): AttentionConfig(
        fwd=Tiles(128, 128, 8, 3), dkdv=Tiles(32, 128, 8, 4), dq=Tiles(128, 64, 8, 3), delta_rows=64,
        resident_direct=True, stat_base=True, fwd_tma=True, fwd_ws=True, bwd_ws=True),
    (128, torch.float32): AttentionConfig(
        fwd=Tiles(64, 32, 4, 2), dkdv=Tiles(32, 64, 8, 2), dq=Tiles(64, 32, 8, 2), delta_rows=64),
    (64, torch.bfloat16): AttentionConfig(
        fwd=Tiles(128, 64, 4, 3), dkdv=Tiles(32, 128, 4, 4), dq=Tiles(128, 32, 4, 4), delta_rows=64),
    (64, torch.float32): AttentionConfig(
        fwd=Tiles(64, 32, 4, 2), dkdv=Tiles(32, 64, 4, 2), dq=Tiles(64, 32, 4, 2), delta_rows=64),
    (32, torch.bfloat16): _SMALL, (32, torch.float32): _SMALL,
    (16, torch.bfloat16): _SMALL, (16, torch.float32): _SMALL,
})
HEAD_DIMS = (16, 32, 64, 128)
_DOT_PRECISION = "ieee"


def config_for(head_dim: int, dtype: torch.dtype) -> AttentionConfig:
    """The frozen configuration of ``(head_dim, dtype)``; raises ValueError for an unsupported pair."""
    cfg = CONFIGS.get((head_dim, dtype))
    if cfg is None:
        raise ValueError(f"strict joint attention supports head_dim in {HEAD_DIMS} and dtypes fp32/bf16, got {head_dim}, {dtype}")
    return cfg


def _check_config(cfg: object) -> AttentionConfig:
    if not isinstance(cfg, AttentionConfig):
        raise ValueError(f"expected an AttentionConfig, got {type(cfg).__name__}")
    return cfg


# ----------------------------------------------------------------------------------------------
# Host functions
# ----------------------------------------------------------------------------------------------

_TABLES: dict[tuple, tuple[torch.Tensor, int]] = {}


def _tile_table(tseq: tuple[int, ...], iseq: tuple[int, ...], block: int, device: torch.device,
                qseq: tuple[int, ...] | None = None) -> tuple[torch.Tensor, int]:
    """Device table of ``block``-row tiles cut from every sample's text and image segments; cached.

    ``qseq`` (query subsets, forward only): the image query rows per sample live in their own buffer
    (``sum(qseq)`` rows, a subset of each sample's image rows) while the keys and values are the whole
    samples' (``iseq``); image query tiles are cut from each sample's query segment, and the stat rows
    follow the query buffer. Returns ``(table (tiles, 9) int32, tiles)``; the column meanings are listed
    above the kernels.
    """
    key = (tseq, iseq, block, str(device), qseq)
    hit = _TABLES.get(key)
    if hit is not None:
        return retain(hit)
    mt = sum(tseq)
    rows: list[list[int]] = []
    ts = is_ = qs = 0
    for nt, ni, nq in zip(tseq, iseq, qseq if qseq is not None else iseq):
        sample = [ts, nt, is_, ni, mt + is_]
        for stream, start, n, stat in ((0, ts, nt, ts), (1, qs, nq, mt + qs)):  # qs == is_ without qseq
            for off in range(0, n, block):
                rows.append([stream, start + off, start + n, stat + off] + sample)
        ts += nt
        is_ += ni
        qs += nq
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
    if not getattr(_ALLOCATOR_SET, "done", False) and not interpreting():
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        _ALLOCATOR_SET.done = True


def _tma_fits(*tensors: torch.Tensor) -> bool:
    """Whether tensor descriptors can read these bases (16-byte aligned); sets Triton's allocator when they can.

    Where they cannot, the forward reads through pointers: both paths load the same values, so the bytes agree.
    """
    if any(t.data_ptr() % 16 for t in tensors if t.numel()):
        return False
    _ensure_allocator()
    return True


def _ws_fits(cfg: AttentionConfig, dtype: torch.dtype, d: int, tma: bool, *queries: torch.Tensor) -> bool:
    """Whether the warp-specialized forward serves this call: ValueError for a configuration it cannot run;
    False (the Triton forward) under the interpreter, on a GPU other than sm_90 (the kernel is Hopper wgmma), without
    Gluon, or when a base is not 16-byte aligned (same bytes on sm_90)."""
    f = cfg.fwd
    if dtype != torch.bfloat16 or d != 128 or (f.block_m, f.block_n) != (attention_ws.BLOCK_M, 128) or not 2 <= f.stages <= 3:
        raise ValueError(f"fwd_ws runs bf16, d = 128, fwd tiles (128, 128) and 2-3 stages; got {dtype}, d = {d}, fwd {f}")
    if not cfg.fwd_tma:
        raise ValueError("fwd_ws loads through TMA: set fwd_tma")
    return tma and _hopper_ws_runs(attention_ws, *queries)


def _bwd_ws_fits(cfg: AttentionConfig, dtype: torch.dtype, d: int, *tensors: torch.Tensor) -> bool:
    """Whether the warp-specialized dK/dV kernel serves this call: ValueError for a configuration it cannot run;
    False (the Triton dK/dV kernel) under the interpreter, on a GPU other than sm_90, without Gluon, or when a base
    is not 16-byte aligned (same bytes on sm_90)."""
    t = cfg.dkdv
    if (dtype != torch.bfloat16 or d != 128 or t.block_n != attention_bwd_ws.BLOCK_N
            or t.block_m not in attention_bwd_ws.BLOCK_MS or not 2 <= t.stages <= attention_bwd_ws.max_stages(t.block_m)):
        raise ValueError(f"bwd_ws runs bf16, d = 128, dkdv tiles ({'|'.join(map(str, attention_bwd_ws.BLOCK_MS))}, "
                         f"{attention_bwd_ws.BLOCK_N}) and 2 to {attention_bwd_ws.max_stages(t.block_m)} stages "
                         f"(shared memory); got {dtype}, d = {d}, dkdv {t}")
    return _hopper_ws_runs(attention_bwd_ws, *tensors)


def _hopper_ws_runs(module: Any, *tensors: torch.Tensor) -> bool:
    """Whether a warp-specialized (Gluon, sm_90) kernel of ``module`` can run on ``tensors``: not under the interpreter,
    16-byte aligned bases (:func:`_tma_fits`, which sets Triton's allocator), Gluon present and an sm_90 GPU."""
    return (not interpreting() and _tma_fits(*tensors) and module.available()
            and torch.cuda.get_device_capability(tensors[0].device)[0] == 9)


def _launch_opts(warps: int, stages: int) -> dict:
    return launch_opts(warps, interpreting(), num_stages=stages)


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


def check_inputs(q_txt, k_txt, v_txt, q_img, k_img, v_img, txt_seqlens, img_seqlens,
                 query_img_seqlens=None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate a call (docs/operators.md); returns the seqlens as int tuples or raises ValueError.
    With ``query_img_seqlens`` q_img holds a subset of each sample's image rows (checked by the caller)."""
    names = ("q_txt", "k_txt", "v_txt", "q_img", "k_img", "v_img")
    tensors = (q_txt, k_txt, v_txt, q_img, k_img, v_img)
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"expected {name} of shape (rows, H, d), got {getattr(t, 'shape', type(t).__name__)}")
    dtype, device = q_img.dtype, q_img.device
    if dtype not in DTYPES:
        raise ValueError(f"strict joint attention runs fp32 or bf16, got {dtype}")
    if device.type != "cuda" and not (interpreting() and device.type == "cpu"):
        raise ValueError(f"the triton joint attention needs CUDA tensors (CPU only under TRITON_INTERPRET=1), got {device}")
    heads, head_dim = q_img.shape[1:]
    config_for(head_dim, dtype)
    for name, t in zip(names, tensors):
        if t.shape[1:] != (heads, head_dim):
            raise ValueError(f"expected {name} of shape (rows, {heads}, {head_dim}), got {tuple(t.shape)}")
        check_operand(name, t, dtype, device, dtype_of="q_img's", layout="rows, H, d")
    if not (q_txt.shape == k_txt.shape == v_txt.shape):
        raise ValueError(f"q_txt, k_txt, v_txt must have one shape, got {tuple(q_txt.shape)}, {tuple(k_txt.shape)}, {tuple(v_txt.shape)}")
    if not ((q_img.shape == k_img.shape or query_img_seqlens is not None) and k_img.shape == v_img.shape):
        raise ValueError(f"q_img, k_img, v_img must have one shape, got {tuple(q_img.shape)}, {tuple(k_img.shape)}, {tuple(v_img.shape)}")
    tseq = _seqlens(txt_seqlens, q_txt.shape[0], "txt_seqlens")
    iseq = _seqlens(img_seqlens, k_img.shape[0], "img_seqlens")
    if len(tseq) != len(iseq):
        raise ValueError(f"txt_seqlens has {len(tseq)} samples but img_seqlens has {len(iseq)}")
    if len(tseq) == 0:
        raise ValueError("strict joint attention needs at least one sample")
    return tseq, iseq


def _sample_tiles(tseq, iseq, block: int, device: torch.device, only_sample: int | None,
                  qseq: tuple[int, ...] | None = None) -> tuple[torch.Tensor, int]:
    table, n = _tile_table(tseq, iseq, block, device, qseq)
    if only_sample is None:
        return table, n
    keep = (table[:, 4] == sum(tseq[:only_sample])) & (table[:, 6] == sum(iseq[:only_sample]))
    table = table[keep].contiguous()
    return table, table.shape[0]


def attention_fwd(q_txt, k_txt, v_txt, q_img, k_img, v_img, tseq, iseq, cfg: AttentionConfig | None = None, *,
                  out: tuple | None = None, only_sample: int | None = None, qseq: tuple[int, ...] | None = None):
    """Forward on validated inputs. Returns ``(o_txt (Mt, H, d), o_img (Mi, H, d), lse (Mt+Mi, H) fp32)``.

    ``cfg`` replaces the frozen configuration (benchmark candidates only). ``out`` (o_txt, o_img, lse)
    and ``only_sample`` (launch the tiles of that sample alone) exist for the tests that prove no
    program writes outside its own sample's rows. ``qseq``: q_img holds that many query rows per sample
    (a subset of its image rows, against the whole samples' keys); ``Mi`` is then ``sum(qseq)`` and the
    Triton forward runs (the warp-specialized one anchors queries at the keys' segment; same bytes).
    """
    heads, d = q_img.shape[1:]
    cfg = _check_config(cfg or config_for(d, q_img.dtype))
    f = cfg.fwd
    tma = cfg.fwd_tma and _tma_fits(k_txt, k_img, v_txt, v_img)
    if out is None:
        out = (torch.empty_like(q_txt), torch.empty_like(q_img),
               torch.empty((q_txt.shape[0] + q_img.shape[0], heads), dtype=torch.float32, device=q_img.device))
    o_txt, o_img, lse = out
    table, n_tiles = _sample_tiles(tseq, iseq, f.block_m, q_img.device, only_sample, qseq)
    qk_scale, _ = _scales(d)
    if cfg.fwd_ws and qseq is None and n_tiles and _ws_fits(cfg, q_img.dtype, d, tma, q_txt, q_img):
        attention_ws.launch(q_txt, k_txt, v_txt, q_img, k_img, v_img, o_txt, o_img, lse, table, n_tiles, heads, d,
                            qk_scale, f.block_n, f.stages)
    elif n_tiles:
        bound(_attn_fwd_kernel)[(n_tiles, heads)](
            q_txt, k_txt, v_txt, q_img, k_img, v_img, o_txt, o_img, lse, table,
            heads * d, heads, qk_scale,
            D=d, BLOCK_M=f.block_m, BLOCK_N=f.block_n, DOT_PRECISION=_DOT_PRECISION, TMA=tma,
            RESIDENT_DIRECT=cfg.resident_direct, **_launch_opts(f.warps, f.stages))
    return o_txt, o_img, lse


def attention_bwd(do_txt, do_img, q_txt, k_txt, v_txt, q_img, k_img, v_img, o_txt, o_img, lse, tseq, iseq,
                  cfg: AttentionConfig | None = None, *, out: tuple | None = None, only_sample: int | None = None):
    """Backward: ``(dq_txt, dk_txt, dv_txt, dq_img, dk_img, dv_img)``, each like its input.

    do_*, o_*: ``(M, H, d)`` contiguous in the input dtype; lse from :func:`attention_fwd`. ``cfg``, ``out`` and
    ``only_sample`` as in :func:`attention_fwd`.
    """
    heads, d = q_img.shape[1:]
    cfg = _check_config(cfg or config_for(d, q_img.dtype))
    dev = q_img.device
    qk_scale, sm_scale = _scales(d)
    delta = torch.empty_like(lse)
    table, n = _sample_tiles(tseq, iseq, cfg.delta_rows, dev, only_sample)
    if n:
        bound(_bwd_delta_kernel)[(n, heads)](o_txt, o_img, do_txt, do_img, delta, table, heads * d, heads,
                                             D=d, BLOCK_M=cfg.delta_rows, **_launch_opts(4, 1))
    if out is None:
        out = tuple(torch.empty_like(t) for t in (q_txt, k_txt, v_txt, q_img, k_img, v_img))
    dq_txt, dk_txt, dv_txt, dq_img, dk_img, dv_img = out
    t = cfg.dkdv
    table, n = _sample_tiles(tseq, iseq, t.block_n, dev, only_sample)
    if n and cfg.bwd_ws and _bwd_ws_fits(cfg, q_img.dtype, d, q_txt, k_txt, v_txt, q_img, k_img, v_img, do_txt, do_img):
        attention_bwd_ws.launch(q_txt, k_txt, v_txt, q_img, k_img, v_img, do_txt, do_img, dk_txt, dv_txt, dk_img, dv_img,
                                lse, delta, table, n, heads, d, qk_scale, sm_scale, t.block_m, t.stages)
    elif n:
        bound(_attn_bwd_dkdv_kernel)[(n, heads)](
            q_txt, k_txt, v_txt, q_img, k_img, v_img, do_txt, do_img, dk_txt, dv_txt, dk_img, dv_img, lse, delta, table,
            heads * d, heads, qk_scale, sm_scale,
            D=d, BLOCK_M=t.block_m, BLOCK_N=t.block_n, DOT_PRECISION=_DOT_PRECISION,
            RESIDENT_DIRECT=cfg.resident_direct, STAT_BASE=cfg.stat_base, **_launch_opts(t.warps, t.stages))
    t = cfg.dq
    table, n = _sample_tiles(tseq, iseq, t.block_m, dev, only_sample)
    if n:
        bound(_attn_bwd_dq_kernel)[(n, heads)](
            q_txt, k_txt, v_txt, q_img, k_img, v_img, do_txt, do_img, dq_txt, dq_img, lse, delta, table,
            heads * d, heads, qk_scale, sm_scale,
            D=d, BLOCK_M=t.block_m, BLOCK_N=t.block_n, DOT_PRECISION=_DOT_PRECISION,
            RESIDENT_DIRECT=cfg.resident_direct, **_launch_opts(t.warps, t.stages))
    return out


class JointAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: gradients for the six q/k/v inputs (no atomics; see the module docstring)."""

    @staticmethod
    def forward(ctx, q_txt, k_txt, v_txt, q_img, k_img, v_img, tseq, iseq, cfg):
        def compute():
            return attention_fwd(q_txt, k_txt, v_txt, q_img, k_img, v_img, tseq, iseq, cfg)

        # a checkpointed forward keeps its outputs for the recompute of this call (kernels/kept_outputs.py)
        kept = current().kept_outputs
        o_txt, o_img, lse = compute() if kept is None else kept.run(compute)
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
    txt_seqlens: Sequence[int], img_seqlens: Sequence[int], config: AttentionConfig | None = None,
    query_img_seqlens: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed joint attention (docs/operators.md).

    q/k/v_txt: ``(Mt, H, d)``, q/k/v_img: ``(Mi, H, d)``, one dtype (fp32 | bf16), contiguous, on CUDA;
    ``txt_seqlens``/``img_seqlens``: rows per sample in each stream (one entry per sample each).
    Returns ``(o_txt (Mt, H·d), o_img (Mi, H·d))`` in the input dtype; differentiable in all six inputs.
    ``config`` replaces the frozen configuration (benchmark candidates only; not for model use).
    ``query_img_seqlens`` (forward only): q_img holds that many image query rows per sample — a subset of
    its image rows, as a sequence-parallel rank holds them — against the whole samples' keys and values;
    o_img then has those rows. Each query row's bytes are its whole-sample call's (queries are row-local).
    """
    qseq = None
    if query_img_seqlens is not None:
        qseq = _seqlens(query_img_seqlens, q_img.shape[0], "query_img_seqlens")
    tseq, iseq = check_inputs(q_txt, k_txt, v_txt, q_img, k_img, v_img, txt_seqlens, img_seqlens, qseq)
    if qseq is not None:
        if len(qseq) != len(iseq) or any(q > n for q, n in zip(qseq, iseq)):
            raise ValueError(f"query_img_seqlens {qseq} must give each of the {len(iseq)} samples at most its "
                             f"image rows {iseq}")
        tensors = (q_txt, k_txt, v_txt, q_img, k_img, v_img)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            raise ValueError("joint attention over query subsets is forward only (run it under torch.no_grad())")
        o_txt, o_img, _ = attention_fwd(*tensors, tseq, iseq, config, qseq=qseq)
        return o_txt.view(o_txt.shape[0], -1), o_img.view(o_img.shape[0], -1)
    if config is not None:
        _check_config(config)
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
    op="joint_attention_fused", backend="triton", device="cuda", dtypes=frozenset(DTYPES), fn=joint_attention_fused,
    strict=True, split_k=False,
    kernel_name=("_attn_fwd_ws_kernel/_attn_fwd_kernel/_bwd_delta_kernel/_attn_bwd_dkdv_ws_kernel/_attn_bwd_dkdv_kernel/"
                 "_attn_bwd_dq_kernel"),
    source=(sys.modules[__name__], attention_fwd_kernels, attention_bwd_kernels, attention_ws, attention_bwd_ws),
    config={"table": "mmdit_strict.kernels.triton.attention.CONFIGS", "keyed_by": "(head_dim, dtype)",
            "dot_precision": _DOT_PRECISION, "fp_fusion": False,
            "bf16_d128": CONFIGS[(128, torch.bfloat16)].as_dict()},
    reduction_order=REDUCTION_ORDER, accumulator="fp32",
))

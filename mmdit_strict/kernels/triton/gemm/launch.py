"""Host side of the strict GEMM engine: input checks, configuration lookup and kernel launches.

Every launch takes its configuration from ``configs`` by ``(N, K, dtype)`` — or, for benchmarks
timing a candidate, from an explicit ``config=`` argument — never from M. Shapes and dtypes:
``x (M, K)``, ``weight (N, K)`` as nn.Linear stores it, ``bias (N,)``, LoRA ``A (r, K)``,
``B (N, r)``; FP32 or BF16, contiguous; CUDA, or CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ....dtypes import EXECUTION_DTYPES
from ...checks import check_operand
from ...keepalive import retain
from ...prologues import prologue_pass
from ...streams import configured_columns, current_gemm_stream
from .. import configs as _configs
from ..bound import bound, cdiv, next_power_of_2
from . import kernels as _k
from .codes import EPILOGUES, PROLOGUES, Act
from .cuda_context import ensure_cuda_context
from .weights import prepacked_weight

DTYPES = EXECUTION_DTYPES  # the dtypes every strict Triton kernel executes in
_DOT_PRECISION = "ieee"
_INTERPRETER_PROGRAMS = 3  # persistent programs under the interpreter: several tiles per program


@functools.cache
def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET``). Read once: Triton itself decides
    when a kernel is decorated, so the answer cannot change for kernels already imported."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def launch_opts(num_warps: int, interpreting: bool, **limits: int | None) -> dict:
    """The compile options of every strict launch: none under the interpreter; else ``num_warps``,
    ``enable_fp_fusion=False`` (no multiply-add contracted) and each of ``limits`` (``num_stages``,
    ``maxnreg``) that is not None. ``interpreting`` is :func:`interpreting`'s answer: the
    offline sm_90 compile tools (benchmarks/rows_sass.py, attention_sass.py) replace that per module."""
    if interpreting:
        return {}
    return {"num_warps": num_warps, "enable_fp_fusion": False, **{k: v for k, v in limits.items() if v is not None}}


def check_dtype_device(op: str, name: str, t: torch.Tensor, interpreting: bool) -> None:
    """A row kernel's operand ``t``: fp32|bf16, on CUDA (CPU only under the interpreter), else ValueError.
    ``interpreting`` as in :func:`launch_opts`."""
    if t.dtype not in DTYPES:
        raise ValueError(f"{op}: strict kernels run fp32 or bf16, got {name} of dtype {t.dtype}")
    if not (t.device.type == "cuda" or (interpreting and t.device.type == "cpu")):
        raise ValueError(f"{op}: the triton backend needs CUDA tensors (CPU only under TRITON_INTERPRET=1), got {name} on {t.device}")


def _launch_opts(num_warps: int, num_stages: int | None = None) -> dict:
    return launch_opts(num_warps, interpreting(), num_stages=num_stages)


def _pow2_at_least(n: int, lo: int = 16) -> int:
    return max(lo, next_power_of_2(max(int(n), 1)))


_STARTS: dict[tuple, torch.Tensor] = {}


def _starts(seqlens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Row offsets ``[0, s0, s0+s1, …]`` (int32) of the samples, cached per (seqlens, device)."""
    key = (seqlens, str(device))
    t = _STARTS.get(key)
    if t is None:
        offs = [0]
        for n in seqlens:
            offs.append(offs[-1] + n)
        t = torch.tensor(offs, dtype=torch.int32, device=device)
        if len(_STARTS) > 4096:
            _STARTS.clear()
        _STARTS[key] = t
    return retain(t)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _num_programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM (the tile loop keeps each SM busy)."""
    if device.type != "cuda":
        return _INTERPRETER_PROGRAMS
    return _sm_count(_device_index(device))


# ----------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------


def _check_tensor(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"expected {name} to be a tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = "(" + ", ".join("?" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"expected {name} of shape {want}, got {tuple(t.shape)}")
    check_operand(name, t, dtype, device)


def check_inputs(x, weight, bias, seqlens, prologue, epilogue, lora) -> None:
    """Validate a GEMM-family call (docs/operators.md); raises ValueError with the reason."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"expected x of shape (M, K), got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"strict GEMM runs fp32 or bf16, got x of dtype {x.dtype}")
    if x.device.type != "cuda" and not (interpreting() and x.device.type == "cpu"):
        raise ValueError(f"the triton GEMM backend needs CUDA tensors (CPU only under TRITON_INTERPRET=1), got {x.device}")
    m, k = x.shape
    _check_tensor("x", x, (m, k), x.dtype, x.device)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"expected weight of shape (N, {k}), got {getattr(weight, 'shape', type(weight).__name__)}")
    n = weight.shape[0]
    _check_tensor("weight", weight, (n, k), x.dtype, x.device)
    if bias is not None:
        _check_tensor("bias", bias, (n,), x.dtype, x.device)
    if not isinstance(seqlens, tuple) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seqlens):
        raise ValueError(f"expected seqlens as a tuple of non-negative Python ints, got {seqlens!r}")
    if sum(seqlens) != m:
        raise ValueError(f"seqlens sum to {sum(seqlens)} but x has {m} rows")
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {tuple(PROLOGUES)}, got {prologue!r}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {tuple(EPILOGUES)}, got {epilogue!r}")
    if lora is not None:
        if not (isinstance(lora, tuple) and len(lora) == 3):
            raise ValueError("lora must be None or a tuple (A (r, K), B (N, r), scale)")
        a, b, scale = lora
        if not isinstance(a, torch.Tensor) or a.dim() != 2:
            raise ValueError(f"expected lora A of shape (r, {k}), got {getattr(a, 'shape', type(a).__name__)}")
        r = a.shape[0]
        if r < 1:
            raise ValueError("lora rank must be at least 1")
        _check_tensor("lora A", a, (r, k), x.dtype, x.device)
        _check_tensor("lora B", b, (n, r), x.dtype, x.device)
        if not isinstance(scale, (int, float)) or isinstance(scale, bool):
            raise ValueError(f"lora scale must be a Python float, got {type(scale).__name__}")


# ----------------------------------------------------------------------------------------------
# The main kernel
# ----------------------------------------------------------------------------------------------


class Operand(NamedTuple):
    """The ``b`` operand of the main kernel, read as ``(K, N)``: ``tensor`` with element (k, n) at
    ``k·strides[0] + n·strides[1]``. ``nk``: ``tensor`` is an ``(N, K)`` row-major matrix read in
    place (strides ``(1, K)``); tensor-descriptor loads then take ``(BLOCK_N, BLOCK_K)`` boxes and
    transpose them before the dot."""

    tensor: torch.Tensor
    strides: tuple[int, int]
    nk: bool = False


class Lora(NamedTuple):
    """The LoRA term of a main-kernel launch: ``scale · u @ l`` with ``u (M, R)`` and ``l`` read as
    ``(R, N)`` through ``l_strides``."""

    u: torch.Tensor
    l: torch.Tensor
    l_strides: tuple[int, int]
    scale: float


def _use_tma(cfg: _configs.FwdConfig, a: torch.Tensor, b: Operand, bk: int, bn: int, prologue: int) -> bool:
    """Tensor-descriptor loads when the shape class asks for them and the copy engine can serve the
    operands (Hopper or newer, or the interpreter; 16-byte aligned bases and row strides, unit inner
    stride, no fused prologue). Falls back to pointer loads otherwise; the arithmetic is the same."""
    if not cfg.tma or prologue:
        return False
    if a.device.type == "cuda":
        if _capability_major(_device_index(a.device)) < 9:
            return False
    elif not interpreting():
        return False
    es = a.element_size()
    row_stride = b.strides[1] if b.nk else b.strides[0]
    inner_ok = b.strides[0] == 1 if b.nk else b.strides[1] == 1
    return (inner_ok and a.data_ptr() % 16 == 0 and b.tensor.data_ptr() % 16 == 0 and (a.stride(0) * es) % 16 == 0
            and (row_stride * es) % 16 == 0 and a.stride(1) == 1 and bk * es >= 16 and bn * es >= 16)


class _Plan(NamedTuple):
    """What a main-kernel launch derives from its key: tile widths, grid, specialization and options."""

    bn: int
    bk: int
    split: int
    grid: tuple[int]
    use_tma: bool
    tma_store: bool
    kw: dict


_PLANS: dict[tuple, _Plan] = {}


def _plan(key: tuple, a: torch.Tensor, b: Operand, n_out: int, cfg: _configs.FwdConfig, prologue: int, epilogue: int,
          has_bias: bool, lora: Lora | None, store_pre: bool, out: torch.Tensor) -> _Plan:
    """Derive the plan of a launch whose key missed the cache, and keep it under ``key``."""
    m, k = a.shape
    bn = min(cfg.BLOCK_N, _pow2_at_least(n_out))
    bk = min(cfg.BLOCK_K, _pow2_at_least(k))
    tiles = cdiv(m, cfg.BLOCK_M) * cdiv(n_out, bn)
    nprog = _num_programs(a.device) if cfg.persistent else 0
    use_tma = _use_tma(cfg, a, b, bk, bn, prologue)
    split = cfg.epi_split if bn % (16 * cfg.epi_split) == 0 else 1  # parts narrower than 16 columns: one part
    # a widened output (out_dtype) leaves through pointer stores: an FP32 tile doubles the store's shared-memory
    # staging, which the configurations were not tuned (or checked to fit) for; the store path moves no arithmetic
    tma_store = use_tma and cfg.tma_store and out.dtype == a.dtype and (n_out * out.element_size()) % 16 == 0
    r = lora.u.shape[1] if lora is not None else 0
    spec = _k.FwdSpec(
        PROLOGUE=int(prologue), EPILOGUE=int(epilogue), HAS_BIAS=has_bias, HAS_LORA=lora is not None,
        STORE_PRE=store_pre, EVEN_K=(k % bk == 0), DOT_PRECISION=_DOT_PRECISION,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, BLOCK_R=min(64, _pow2_at_least(r)), GROUP_M=cfg.GROUP_M,
        USE_TMA=use_tma, W_NK=use_tma and b.nk, TMA_STORE=tma_store, EPI_SPLIT=split, NUM_PROGRAMS=nprog,
    )
    plan = _Plan(bn, bk, split, (min(tiles, nprog) if nprog else tiles,), use_tma, tma_store,
                 {"CFG": spec, **_launch_opts(cfg.num_warps, cfg.num_stages)})
    if len(_PLANS) >= 4096:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def _aligned(t: torch.Tensor | None) -> bool | None:
    return None if t is None else t.data_ptr() & 15 == 0


def _main(a: torch.Tensor, b: Operand, n_out: int, cfg: _configs.FwdConfig, *, prologue: int = Act.NONE,
          epilogue: int = Act.NONE, bias: torch.Tensor | None = None, lora: Lora | None = None,
          aux: torch.Tensor | None = None, store_pre: bool = False, out_dtype: torch.dtype | None = None,
          on_launch: Callable[[object], None] | None = None,
          gate: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the main kernel: ``out (M, n_out) = epi(p(a) (M, K) @ b (K, n_out) + …)`` with ``cfg``.

    Returns ``(out, pre)`` (``pre`` only with ``store_pre``). ``out_dtype``: the dtype ``out`` is
    stored in (default ``a``'s; the kernel's one cast goes to it, so FP32 keeps the accumulator
    unrounded). ``on_launch`` receives the compiled kernel handle (benchmarks read its registers and spills).
    ``gate``: ``(gate (B, n_out), row samples (M,) int32)`` of the ``GATE_RESIDUAL`` epilogue (``aux`` is then
    the residual); None passes no argument, so every other launch compiles as if the epilogue did not exist.

    The launch's plan (tiles, grid, specialization) is derived once per key — every shape, stride, dtype, flag
    and operand alignment the launch depends on — and the kernel is launched bound to that key
    (:meth:`~mmdit_strict.kernels.triton.bound.BoundKernel.launch_keyed`)."""
    m, k = a.shape
    out = torch.empty((m, n_out), dtype=out_dtype or a.dtype, device=a.device)
    pre = torch.empty((m, n_out), dtype=a.dtype, device=a.device) if store_pre else None
    if m == 0 or n_out == 0:
        return out, pre
    if k == 0:
        raise ValueError("the strict GEMM engine needs K >= 1")
    bt = b.tensor
    key = (a.device, a.dtype, bt.dtype, out.dtype, m, k, n_out, a.stride(0), a.stride(1), b.strides, b.nk, cfg,
           int(prologue), int(epilogue), store_pre,
           None if lora is None else (lora.u.shape[1], lora.u.stride(0), lora.l_strides, lora.u.dtype, lora.l.dtype),
           None if aux is None else (aux.dtype, aux.stride(0)), None if bias is None else bias.dtype,
           _aligned(a), _aligned(bt), _aligned(out), _aligned(pre), _aligned(bias), _aligned(aux),
           None if lora is None else (_aligned(lora.u), _aligned(lora.l)),
           None if gate is None else (gate[0].dtype, gate[0].stride(0), _aligned(gate[0]), _aligned(gate[1])))
    plan = _PLANS.get(key) or _plan(key, a, b, n_out, cfg, prologue, epilogue, bias is not None, lora, store_pre, out)
    a_arg, b_arg, out_desc = a, bt, out
    if plan.use_tma:
        if a.device.type == "cuda":
            ensure_cuda_context(a.device)
        a_arg = TensorDescriptor(a, [m, k], [a.stride(0), 1], [cfg.BLOCK_M, plan.bk])
        if b.nk:
            b_arg = TensorDescriptor(bt, [n_out, k], [b.strides[1], 1], [plan.bn, plan.bk])
        else:
            b_arg = TensorDescriptor(bt, [k, n_out], [b.strides[0], 1], [plan.bk, plan.bn])
        if plan.tma_store:
            out_desc = TensorDescriptor(out, [m, n_out], [out.stride(0), 1], [cfg.BLOCK_M, plan.bn // plan.split])
    strides = (a.stride(0), b.strides[0], b.strides[1], out.stride(0))
    if lora is not None:
        lora_args = (lora.u, lora.u.stride(0), lora.l, lora.l_strides[0], lora.l_strides[1], lora.u.shape[1],
                     float(lora.scale))
    else:
        lora_args = (out, 0, out, 0, 0, 0, 1.0)
    epi = (bias if bias is not None else out, aux if aux is not None else out, aux.stride(0) if aux is not None else 0,
           out, pre if pre is not None else out)
    kernel = bound(_k._gemm_fwd_kernel)
    gate_args = None if gate is None else (gate[0], gate[0].stride(0), gate[1])
    args = (a_arg, b_arg, out_desc, strides, lora_args, epi, m, n_out, k, gate_args)
    compiled = kernel[plan.grid](*args, **plan.kw) if interpreting() else kernel.launch_keyed(key, plan.grid, args, plan.kw)
    if on_launch is not None:
        on_launch(compiled)
    return out, pre


# ----------------------------------------------------------------------------------------------
# Gradient reductions and elementwise passes
# ----------------------------------------------------------------------------------------------


def gemm_dw(g: torch.Tensor, x: torch.Tensor, seqlens: tuple[int, ...], *, prologue: str = "none",
            scale: float = 1.0, accumulate_into: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None, config: _configs.DwConfig | None = None) -> torch.Tensor:
    """Per-sample weight gradient ``Σ_s scale · g[s]ᵀ p(x[s])``, folded in sample order.

    Args:
        g: (M, N) upstream gradient of the pre-activation, execution dtype.
        x: (M, K) layer input (pre-prologue), same dtype.
        seqlens: rows per sample, sum M.
        accumulate_into: optional (N, K) FP32 buffer holding an earlier fold; the samples are folded
            onto it (``acc = acc + scale·P_s``) and the buffer is returned updated — micro-batches
            folded this way in sample order give the same bytes as one call over all samples.
        out_dtype: dtype of the returned gradient (default g's dtype; FP32 to keep the fold).
        config: the launch configuration (default ``configs.dw_config(N, K, dtype)``; benchmarks
            pass candidates here).
    Returns:
        (N, K) gradient.
    """
    m, n = g.shape
    k = x.shape[1]
    if x.shape[0] != m or sum(seqlens) != m or g.dtype != x.dtype or not (g.is_contiguous() and x.is_contiguous()):
        raise ValueError(f"gemm_dw expects contiguous g (M, N), x (M, K) of one dtype with sum(seqlens) == M; "
                         f"got g {tuple(g.shape)} {g.dtype}, x {tuple(x.shape)} {x.dtype}, sum(seqlens) {sum(seqlens)}")
    cfg = config or _configs.dw_config(n, k, g.dtype)
    bn = min(cfg.BLOCK_N, _pow2_at_least(n))
    bk = min(cfg.BLOCK_K, _pow2_at_least(k))
    if accumulate_into is not None:
        if accumulate_into.shape != (n, k) or accumulate_into.dtype != torch.float32 or not accumulate_into.is_contiguous():
            raise ValueError(f"accumulate_into must be a contiguous fp32 ({n}, {k}) buffer")
        out = accumulate_into
    else:
        out = torch.empty((n, k), dtype=out_dtype or g.dtype, device=g.device)
    starts = _starts(tuple(seqlens), g.device)
    grid = (cdiv(n, bn) * cdiv(k, bk),)
    spec = _k.DwSpec(PROLOGUE=int(PROLOGUES[prologue]), HAS_INIT=accumulate_into is not None,
                     DOT_PRECISION=_DOT_PRECISION, BLOCK_N=bn, BLOCK_K=bk, BLOCK_M=cfg.BLOCK_M, GROUP_N=cfg.GROUP_N)
    bound(_k._gemm_dw_kernel)[grid](
        g, x, starts, out if accumulate_into is not None else g, out,
        n, k, len(seqlens), g.stride(0), x.stride(0), float(scale), CFG=spec,
        **_launch_opts(cfg.num_warps, cfg.num_stages),
    )
    return out


def gemm_db(g: torch.Tensor, seqlens: tuple[int, ...], *, accumulate_into: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-sample bias gradient ``Σ_s Σ_rows g``, folded in sample order. g: (M, N) → (N,)."""
    m, n = g.shape
    if sum(seqlens) != m or not g.is_contiguous():
        raise ValueError(f"gemm_db expects a contiguous g (M, N) with sum(seqlens) == M; got {tuple(g.shape)}, {sum(seqlens)}")
    if accumulate_into is not None:
        if accumulate_into.shape != (n,) or accumulate_into.dtype != torch.float32:
            raise ValueError(f"accumulate_into must be an fp32 ({n},) buffer")
        out = accumulate_into
    else:
        out = torch.empty((n,), dtype=out_dtype or g.dtype, device=g.device)
    starts = _starts(tuple(seqlens), g.device)
    cfg = _configs.DB
    bound(_k._gemm_db_kernel)[(cdiv(n, cfg.BLOCK_N),)](
        g, starts, out if accumulate_into is not None else g, out, n, len(seqlens), g.stride(0),
        HAS_INIT=accumulate_into is not None, BLOCK_N=cfg.BLOCK_N, BLOCK_M=cfg.BLOCK_M,
        **_launch_opts(cfg.num_warps, cfg.num_stages),
    )
    return out


_SAMPLE_SPANS: dict[tuple, torch.Tensor] = {}


def _sample_spans(seqlens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """(S, 4) int32, row s = ``(start_s, end_s, 0, 0)``: each sample's own ``starts`` pair at a 16-byte
    aligned address, so every one-sample launch binds the same compiled kernel. Cached per (seqlens, device)."""
    key = (seqlens, str(device))
    t = _SAMPLE_SPANS.get(key)
    if t is None:
        rows, start = [], 0
        for n in seqlens:
            rows.append((start, start + n, 0, 0))
            start += n
        t = torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(seqlens), 4)
        if len(_SAMPLE_SPANS) > 4096:
            _SAMPLE_SPANS.clear()
        _SAMPLE_SPANS[key] = t
    return retain(t)


def _partial_outputs(out: Sequence[torch.Tensor] | None, shape: tuple[int, ...], count: int,
                     device: torch.device) -> list[torch.Tensor]:
    """``count`` FP32 buffers of ``shape``: fresh, or the caller's ``out`` after checking them."""
    if out is None:
        return [torch.empty(shape, dtype=torch.float32, device=device) for _ in range(count)]
    out = list(out)
    bad = [t for t in out if tuple(t.shape) != shape or t.dtype != torch.float32 or t.device != device
           or not t.is_contiguous()]
    if len(out) != count or bad:
        raise ValueError(f"out must be {count} contiguous FP32 tensors of shape {shape} on {device}; got "
                         f"{[(tuple(t.shape), t.dtype, str(t.device)) for t in out]}")
    return out


def gemm_dw_samples(g: torch.Tensor, x: torch.Tensor, seqlens: tuple[int, ...], *, prologue: str = "none",
                    scale: float = 1.0, out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Each sample's own weight-gradient partial ``scale · g[s]ᵀ p(x[s])``: S tensors (N, K) FP32, written into
    ``out`` (S contiguous FP32 (N, K) tensors) when given.

    One ``_gemm_dw_kernel`` launch per sample over that sample's rows of the whole ``g`` / ``x`` (its
    row span passed as data, so one compiled kernel serves every sample and batch layout), with the
    configuration :func:`gemm_dw` uses: the same dot chain from the sample's first row, stored as
    ``0 + scale·part`` in FP32 — exactly the term :func:`gemm_dw`'s fold adds for that sample. The
    grad sink folds these in global sample-key order across micro-batches. Shapes and checks as
    :func:`gemm_dw`.
    """
    m, n = g.shape
    k = x.shape[1]
    if x.shape[0] != m or sum(seqlens) != m or g.dtype != x.dtype or not (g.is_contiguous() and x.is_contiguous()):
        raise ValueError(f"gemm_dw_samples expects contiguous g (M, N), x (M, K) of one dtype with sum(seqlens) == M; "
                         f"got g {tuple(g.shape)} {g.dtype}, x {tuple(x.shape)} {x.dtype}, sum(seqlens) {sum(seqlens)}")
    cfg = _configs.dw_config(n, k, g.dtype)
    bn = min(cfg.BLOCK_N, _pow2_at_least(n))
    bk = min(cfg.BLOCK_K, _pow2_at_least(k))
    parts = _partial_outputs(out, (n, k), len(seqlens), g.device)
    spans = _sample_spans(tuple(seqlens), g.device)
    grid = (cdiv(n, bn) * cdiv(k, bk),)
    spec = _k.DwSpec(PROLOGUE=int(PROLOGUES[prologue]), HAS_INIT=False, DOT_PRECISION=_DOT_PRECISION,
                     BLOCK_N=bn, BLOCK_K=bk, BLOCK_M=cfg.BLOCK_M, GROUP_N=cfg.GROUP_N)
    for s, part in enumerate(parts):
        bound(_k._gemm_dw_kernel)[grid](
            g, x, spans[s], g, part, n, k, 1, g.stride(0), x.stride(0), float(scale), CFG=spec,
            **_launch_opts(cfg.num_warps, cfg.num_stages),
        )
    return parts


def gemm_db_samples(g: torch.Tensor, seqlens: tuple[int, ...], *,
                    out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Each sample's own bias-gradient partial ``Σ_rows g[s]``: S tensors (N,) FP32, the terms
    :func:`gemm_db` folds (one launch per sample, as :func:`gemm_dw_samples`; into ``out`` when given)."""
    m, n = g.shape
    if sum(seqlens) != m or not g.is_contiguous():
        raise ValueError(f"gemm_db_samples expects a contiguous g (M, N) with sum(seqlens) == M; got {tuple(g.shape)}, {sum(seqlens)}")
    parts = _partial_outputs(out, (n,), len(seqlens), g.device)
    spans = _sample_spans(tuple(seqlens), g.device)
    cfg = _configs.DB
    for s, part in enumerate(parts):
        bound(_k._gemm_db_kernel)[(cdiv(n, cfg.BLOCK_N),)](
            g, spans[s], g, part, n, 1, g.stride(0), HAS_INIT=False, BLOCK_N=cfg.BLOCK_N, BLOCK_M=cfg.BLOCK_M,
            **_launch_opts(cfg.num_warps, cfg.num_stages),
        )
    return parts


def _elementwise(kernel, src: torch.Tensor, other: torch.Tensor | None, act: Act) -> torch.Tensor:
    out = torch.empty_like(src)
    n = src.numel()
    if n:
        cfg = _configs.ELEMENTWISE
        args = (src, other, out, n) if other is not None else (src, out, n)
        bound(kernel)[(cdiv(n, cfg.BLOCK),)](*args, ACT=int(act), BLOCK=cfg.BLOCK, **_launch_opts(cfg.num_warps))
    return out


def act_bwd(dy: torch.Tensor, z: torch.Tensor, epilogue: str) -> torch.Tensor:
    """dZ = dY · epilogue'(Z), elementwise; dy, z: (M, N) execution dtype."""
    return _elementwise(_k._act_bwd_kernel, dy, z, EPILOGUES[epilogue])


def act_fwd(x: torch.Tensor, act: str) -> torch.Tensor:
    """h = act(x) elementwise (FP32 math, one cast): the prologue pass. x: contiguous."""
    return _elementwise(_k._act_fwd_kernel, x, None, EPILOGUES[act])


# ----------------------------------------------------------------------------------------------
# Forward and backward of one layer
# ----------------------------------------------------------------------------------------------


def _weight_and_lora(x: torch.Tensor, weight: torch.Tensor, lora: tuple | None, cfg: _configs.FwdConfig, stream: str,
                     pro: int) -> tuple[Operand, Lora | None]:
    """The main product's weight operand (as ``cfg.weight_layout`` reads it) and its LoRA term, whose
    ``u = p(x) Aᵀ`` this launches (A (r, K) read as (K, r) through strides, the configuration of its own shape)."""
    k, n = x.shape[1], weight.shape[0]
    b = Operand(prepacked_weight(weight), (n, 1)) if cfg.weight_layout == "kn" else Operand(weight, (1, k), nk=True)
    if lora is None:
        return b, None
    la, lb, scale = lora
    r = la.shape[0]
    u, _ = _main(x, Operand(la, (1, k)), r, _configs.fwd_config(r, k, x.dtype, stream=stream), prologue=pro)
    return b, Lora(u, lb, (1, r), scale)  # B (N, r) read as (r, N)


_SAMPLES: dict[tuple, torch.Tensor] = {}


def _row_samples(seqlens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Each packed row's sample index (int32, (M,)), cached per (seqlens, device). ``cpu.primitives.row_sample_index``
    holds the same map in int64; the kernel's epilogue takes int32 (the int64 table costs its image tile 24 more
    spilled bytes a thread with the LoRA term, sm_90 offline)."""
    key = (seqlens, str(device))
    t = _SAMPLES.get(key)
    if t is None:
        t = torch.tensor([s for s, rows in enumerate(seqlens) for _ in range(rows)], dtype=torch.int32, device=device)
        if len(_SAMPLES) > 4096:
            _SAMPLES.clear()
        _SAMPLES[key] = t
    return retain(t)


def gemm_gate_residual_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                           gate: torch.Tensor, seqlens: tuple[int, ...], lora: tuple | None = None,
                           config: _configs.FwdConfig | None = None) -> torch.Tensor:
    """``residual + gate[s] · y`` per row of sample ``s``, ``y = x Wᵀ + b [+ scale·(x Aᵀ) Bᵀ]`` rounded once to the
    execution dtype first: the bytes of the gated residual applied to :func:`gemm_fwd`'s output, with ``y``
    never written to memory (one launch and two passes over ``(M, N)`` fewer). Forward only: a backward
    needs ``y``. Checked by the caller (:func:`~.autograd.gemm_gate_residual`)."""
    k, n = x.shape[1], weight.shape[0]
    stream = current_gemm_stream()
    cfg = config or _configs.fwd_config(configured_columns(n), k, x.dtype, stream=stream)
    b, lo = _weight_and_lora(x, weight, lora, cfg, stream, Act.NONE)
    out, _ = _main(x, b, n, cfg, epilogue=Act.GATE_RESIDUAL, bias=bias, lora=lo, aux=residual,
                   gate=(gate, _row_samples(seqlens, x.device)))
    return out


def gemm_fwd(x, weight, bias=None, *, prologue="none", epilogue="none", lora=None, store_pre=False,
             return_h=False, config: _configs.FwdConfig | None = None,
             on_launch: Callable[[object], None] | None = None, out_dtype: torch.dtype | None = None):
    """Forward product. x: (M, K), weight: (N, K), bias: (N,) — fp32 or bf16, contiguous.

    Returns ``(y (M, N), pre (M, N) or None, u (M, r) or None)``: the output, the pre-activation
    (stored only when ``store_pre`` and an epilogue is set) and the LoRA intermediate ``p(x) Aᵀ``;
    with ``return_h`` a fourth item, ``p(x)`` when the prologue ran as its own pass (else None).

    ``config``: the main product's configuration (default ``configs.fwd_config(N, K, dtype, stream)`` with
    the stream :func:`~mmdit_strict.kernels.streams.gemm_stream` binds; benchmarks pass candidates here).
    Its ``weight_layout`` picks the weight read: ``"kn"`` the weight's own prepacked ``Wᵀ``
    (:mod:`.weights`), ``"nk"`` W as stored. ``on_launch`` receives the main kernel's compiled handle.

    The SiLU prologue runs as its own elementwise pass (``prologue="pass"``, the default) or fused
    into the main loop (``"fused"``); both round ``silu(x)`` once to the execution dtype before the
    tensor cores, so they give the same bytes — the pass evaluates each element once instead of once
    per ``BLOCK_N`` column tile.

    ``out_dtype``: the dtype of ``y`` — None (the default) or x's dtype: the one cast to the execution
    dtype; ``torch.float32``: the FP32 epilogue result stored unrounded (BF16 operands, FP32 output:
    partial products that a caller sums itself, :mod:`mmdit_strict.kernels.ksplit`). The LoRA
    intermediate and the pre-activation keep the execution dtype.
    """
    if out_dtype is not None and out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"gemm_fwd: out_dtype must be None, x's dtype ({x.dtype}) or torch.float32, got {out_dtype}")
    k = x.shape[1]
    n = weight.shape[0]
    pro = PROLOGUES[prologue]
    # a column shard (tensor parallelism) takes its whole layer's configuration: the same tiles, the same bytes
    stream = current_gemm_stream()
    cfg = config or _configs.fwd_config(configured_columns(n), k, x.dtype, stream=stream)
    h = None
    if pro and cfg.prologue == "pass":
        h = prologue_pass(x, prologue, act_fwd)  # once per forward for a tensor many products read (SiLU(temb))
        x, pro = h, Act.NONE
    b, lo = _weight_and_lora(x, weight, lora, cfg, stream, pro)
    u = None if lo is None else lo.u
    store = store_pre and epilogue != "none"
    y, pre = _main(x, b, n, cfg, prologue=pro, epilogue=EPILOGUES[epilogue], bias=bias, lora=lo,
                   store_pre=store, out_dtype=out_dtype, on_launch=on_launch)
    return (y, pre, u, h) if return_h else (y, pre, u)


def gemm_bwd(dy, x, weight, *, seqlens, prologue="none", epilogue="none", pre=None, lora=None, u=None,
             needs=(True, True, True, True, True), h=None, dx_config: _configs.FwdConfig | None = None,
             deposit: Callable[[int, list[torch.Tensor]], None] | None = None, sums: bool = True,
             deposit_out: Callable[[int], list[torch.Tensor] | None] | None = None, stream: str = "image"):
    """Backward of :func:`gemm_fwd`. dy: (M, N). Returns (dx, dW, db, dA, dB); None where not needed.

    ``h``: ``p(x)`` from the forward's prologue pass, if it ran; dW/dA then read it instead of
    recomputing the prologue per tile (same bytes: the same rounded values enter the same dots).
    ``stream``: the GEMM stream the forward ran in (the backward runs outside its context); dX and the LoRA
    ``v = dZ B`` take that stream's tiles. ``dx_config``: the dX product's configuration (default
    ``configs.fwd_config(K, N, dtype, stream)``).
    ``deposit``: called as ``deposit(i, partials)`` for each parameter gradient computed (i = 1 W,
    2 b, 3 A, 4 B) with that gradient's per-sample FP32 partials (:func:`gemm_dw_samples`,
    :func:`gemm_db_samples`), for the grad sink; the returned gradients are unchanged, except that with
    ``sums=False`` a gradient whose partials were deposited is not summed (returned as None).
    ``deposit_out``: ``deposit_out(i)`` gives the buffers parameter ``i``'s partials are written into, or None
    for fresh ones (a captured backward writes into buffers shared by every captured step)."""
    need_x, need_w, need_b, need_a, need_lb = needs
    k = x.shape[1]
    n = weight.shape[0]
    dz = act_bwd(dy, pre, epilogue) if epilogue != "none" else dy
    dx = dw = db = da = dlb = None
    v = None
    if lora is not None and (need_x or need_a):
        r = lora[0].shape[0]
        v, _ = _main(dz, Operand(lora[1], (r, 1)), r, _configs.fwd_config(r, n, dz.dtype, stream))  # v = dZ B (M, r)
    if need_x:
        lo = Lora(v, lora[0], (k, 1), lora[2]) if lora is not None else None  # + s·v A
        epi, aux = (Act.TIMES_SILU_GRAD, x) if prologue == "silu" else (Act.NONE, None)
        cfg = dx_config or _configs.fwd_config(k, n, dz.dtype, stream)
        dx, _ = _main(dz, Operand(weight, (k, 1)), k, cfg, epilogue=epi, aux=aux, lora=lo)  # dX = dZ W (+ s·v A) [· silu'(x)]
    xw, pw = (h, "none") if h is not None else (x, prologue)
    summed = deposit is None or sums

    def into(i: int) -> list[torch.Tensor] | None:
        return deposit_out(i) if deposit_out is not None else None

    if need_w:
        dw = gemm_dw(dz, xw, seqlens, prologue=pw) if summed else None
        if deposit is not None:
            deposit(1, gemm_dw_samples(dz, xw, seqlens, prologue=pw, out=into(1)))
    if need_b:
        db = gemm_db(dz, seqlens) if summed else None
        if deposit is not None:
            deposit(2, gemm_db_samples(dz, seqlens, out=into(2)))
    if lora is not None:
        if need_a:
            da = gemm_dw(v, xw, seqlens, prologue=pw, scale=lora[2]) if summed else None
            if deposit is not None:
                deposit(3, gemm_dw_samples(v, xw, seqlens, prologue=pw, scale=lora[2], out=into(3)))
        if need_lb:
            dlb = gemm_dw(dz, u, seqlens, scale=lora[2]) if summed else None
            if deposit is not None:
                deposit(4, gemm_dw_samples(dz, u, seqlens, scale=lora[2], out=into(4)))
    return dx, dw, db, da, dlb

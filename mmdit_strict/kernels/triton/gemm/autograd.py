"""Autograd wrapper and public entry point of the strict GEMM engine, and its registry entries.

``gemm`` checks a call against the contract of docs/operators.md, then runs the forward alone
(no gradient needed) or through :class:`GemmFunction`, whose backward is :func:`.launch.gemm_bwd`.
When a grad sink and sample keys are active at the forward (:mod:`mmdit_strict.kernels.grad_sink`),
the backward also hands the sink each sample's FP32 partial of every parameter gradient it computes.
Importing this module registers the engine for the six GEMM-family operators.
"""

from __future__ import annotations

import hashlib
import inspect
import sys

import torch

from ...grad_sink import active as active_grad_sink
from ...streams import current_gemm_stream
from ...registry import KernelImpl, register
from .. import configs as _configs
from . import codes, cuda_context, fpmath, kernels, launch, weights
from .launch import _DOT_PRECISION, DTYPES, _check_tensor, check_inputs, gemm_bwd, gemm_fwd, gemm_gate_residual_fwd


class GemmFunction(torch.autograd.Function):
    """Autograd wrapper: gradients for x, weight, bias and LoRA A/B, each when required."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, seqlens, prologue, epilogue, lora_scale):
        lora = (lora_a, lora_b, lora_scale) if lora_a is not None else None
        y, pre, u, h = gemm_fwd(x, weight, bias, prologue=prologue, epilogue=epilogue, lora=lora, store_pre=True,
                                return_h=True)
        ctx.save_for_backward(x, weight, pre, u, lora_a, lora_b, h)
        # the backward runs on autograd's thread, outside this context: keep the stream for dX's and v's tiles
        ctx.meta = (seqlens, prologue, epilogue, lora_scale, current_gemm_stream())
        sink, keys = active_grad_sink()
        if sink is not None and keys is not None and len(keys) != len(seqlens):
            raise ValueError(f"sample_keys declares {len(keys)} samples but this GEMM sees {len(seqlens)}")
        # the parameter tensors themselves (the sink keys partials by parameter identity), indexed as gemm_bwd's deposit
        ctx.sink = (sink, keys, (None, weight, bias, lora_a, lora_b)) if sink is not None and keys is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, pre, u, lora_a, lora_b, h = ctx.saved_tensors
        seqlens, prologue, epilogue, lora_scale, stream = ctx.meta
        lora = (lora_a, lora_b, lora_scale) if lora_a is not None else None
        ni = ctx.needs_input_grad
        deposit = deposit_out = None
        sums = True
        if ctx.sink is not None:  # a grad sink was active at the forward: hand it each sample's partials
            sink, keys, params = ctx.sink
            sums = sink.autograd_sums

            def deposit(i: int, partials: list[torch.Tensor]) -> None:
                sink.add(params[i], keys, partials, transfer=True)  # FP32 tensors made for (or given by) the sink

            def deposit_out(i: int) -> list[torch.Tensor] | None:
                return sink.partial_buffers(params[i], keys)

        dx, dw, db, da, dlb = gemm_bwd(
            dy.contiguous(), x, weight, seqlens=seqlens, prologue=prologue, epilogue=epilogue, pre=pre,
            lora=lora, u=u, needs=(ni[0], ni[1], ni[2], ni[3], ni[4]), h=h, deposit=deposit, sums=sums,
            deposit_out=deposit_out, stream=stream)
        return dx, dw, db, da, dlb, None, None, None, None


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         seqlens: tuple[int, ...], prologue: str = "none", epilogue: str = "none", lora=None) -> torch.Tensor:
    """GEMM-family operator (docs/operators.md): ``epilogue(p(x) Wᵀ + b + scale·(p(x) Aᵀ) Bᵀ)``.

    x: (M, K) fp32|bf16 contiguous on CUDA; weight: (N, K); bias: (N,) or None; seqlens: rows per
    sample (used by the backward reductions); lora: None or (A (r, K), B (N, r), scale).
    Returns (M, N) in x's dtype. Differentiable in x, weight, bias, A and B.
    """
    check_inputs(x, weight, bias, seqlens, prologue, epilogue, lora)
    la, lb, scale = lora if lora is not None else (None, None, 1.0)
    tensors = [t for t in (x, weight, bias, la, lb) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return GemmFunction.apply(x, weight, bias, la, lb, seqlens, prologue, epilogue, float(scale))
    return gemm_fwd(x, weight, bias, prologue=prologue, epilogue=epilogue, lora=lora)[0]


def gemm_gate_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                       gate: torch.Tensor, *, seqlens: tuple[int, ...], lora=None) -> torch.Tensor:
    """Fused ``adaln_gate_residual(residual, gemm(x, weight, bias, lora), gate)``: ``residual + gate[s] · y`` per
    row of sample ``s``, the product ``y`` rounded once to the execution dtype and never stored; the unfused
    pair's bytes. residual: (M, N) contiguous, x's dtype and device; gate: (B, N) with B = len(seqlens), unit
    column stride (row stride free: a chunk of the modulation product). Forward only: ValueError if a
    gradient is needed (the backward of the gate needs ``y``; run the pair unfused)."""
    check_inputs(x, weight, bias, seqlens, "none", "none", lora)
    m, n = x.shape[0], weight.shape[0]
    _check_tensor("residual", residual, (m, n), x.dtype, x.device)
    if not isinstance(gate, torch.Tensor) or tuple(gate.shape) != (len(seqlens), n):
        raise ValueError(f"expected gate of shape ({len(seqlens)}, {n}) (one row per sample), "
                         f"got {getattr(gate, 'shape', type(gate).__name__)}")
    if gate.dtype != x.dtype or gate.device != x.device:
        raise ValueError(f"expected gate of dtype {x.dtype} on {x.device}, got {gate.dtype} on {gate.device}")
    if len(seqlens) and (gate.stride(1) != 1 or gate.stride(0) < n):
        raise ValueError(f"expected gate with unit column stride, got strides {tuple(gate.stride())}")
    tensors = [t for t in (x, weight, bias, residual, gate, *(lora[:2] if lora is not None else ())) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise ValueError("gemm_gate_residual is forward only: with gradients, run the GEMM and adaln_gate_residual "
                         "unfused (the gate's gradient needs the product's output)")
    return gemm_gate_residual_fwd(x, weight, bias, residual, gate, seqlens, lora=lora)


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------

#: Offer ``gemm_gate_residual`` to the strict model as the fusion of the attention-output and MLP-down products
#: with the gated residual that follows them (forwards without autograd). Off until the GPU has compared its
#: BF16 bytes with the unfused pair and timed it (``tests/kernels/test_triton_gemm.py``); the interpreter
#: checks FP32 on every CI run.
GATE_RESIDUAL_FUSION = False
_GATED_OPS = ("attn_out_bias_gemm", "mlp_down_gemm")
_IMPLS: dict[str, KernelImpl] = {}


def offer_gate_residual_fusion(enabled: bool = True) -> None:
    """Offer (or withdraw) :func:`gemm_gate_residual` as the strict model's fusion of the attention-output and
    MLP-down products with their gated residual. A captured forward keeps what it captured: give a model new
    graphs (``enable_cuda_graphs()``) after a change, to time the other path."""
    for op in _GATED_OPS:
        if enabled:
            _IMPLS[op].fusions["adaln_gate_residual"] = gemm_gate_residual
        else:
            _IMPLS[op].fusions.pop("adaln_gate_residual", None)

GEMM_OPS = ("latent_proj_gemm", "qkv_bias_gemm", "attn_out_bias_gemm", "mlp_up_gemm_gelu",
            "mlp_down_gemm", "adaln_mod_projection")

_REDUCTION_ORDER = (
    "fwd/dX: each (BLOCK_M, BLOCK_N) tile reduced by one program (persistent programs walk several tiles), "
    "K in BLOCK_K steps from 0 by tl.dot into one FP32 accumulator chain, "
    "tiles from (N, K, dtype) and the model stream only (a text tile keeps the K step), no split-K; dW/db: per sample over its "
    "own rows in BLOCK_M chunks from its first row, FP32 partials folded left in sample order"
)
# Every module of the engine: a change to any of them is a new kernel identity in the trace.
_SOURCE = (codes, fpmath, kernels, launch, weights, cuda_context, sys.modules[__name__])
_CONFIGS_SHA256 = hashlib.sha256(inspect.getsource(_configs).encode()).hexdigest()[:16]

for _op in GEMM_OPS:
    _IMPLS[_op] = KernelImpl(
        op=_op, backend="triton", device="cuda", dtypes=frozenset(DTYPES), fn=gemm, strict=True, split_k=False,
        kernel_name="_gemm_fwd_kernel/_gemm_dw_kernel/_gemm_db_kernel/_act_fwd_kernel/_act_bwd_kernel",
        source=_SOURCE,
        config={"table": "mmdit_strict.kernels.triton.configs", "keyed_by": "(N, K, dtype, stream)",
                "configs_sha256": _CONFIGS_SHA256, "dot_precision": _DOT_PRECISION, "fp_fusion": False},
        reduction_order=_REDUCTION_ORDER, accumulator="fp32",
    )
    register(_IMPLS[_op])
offer_gate_residual_fusion(GATE_RESIDUAL_FUSION)

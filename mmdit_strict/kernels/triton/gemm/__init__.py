"""Strict GEMM engine (Triton): every linear layer of the model, forward and backward.

One engine serves the six GEMM-family operators (``latent_proj_gemm``, ``qkv_bias_gemm``,
``attn_out_bias_gemm``, ``mlp_up_gemm_gelu``, ``mlp_down_gemm``, ``adaln_mod_projection``) with the
call contract of ``docs/operators.md``::

    y = epilogue(p(x) Wᵀ + b + scale · (p(x) Aᵀ) Bᵀ)        x (M, K), W (N, K), b (N,), A (r, K), B (N, r)

Arithmetic (docs/design.md §3), frozen here and documented per kernel below:

* Tiles are chosen from ``(N, K, dtype)`` only (``configs.py``), never from M. Each output element
  is reduced by one program over K in ``BLOCK_K`` steps from k = 0 upwards, each step one ``tl.dot``
  into an FP32 accumulator: no split-K, no stream-K, no atomics. A row's bytes therefore depend only
  on that row, W and the configuration — not on M, its position in a tile, or its neighbours.
* BF16 operands run on the tensor cores with FP32 accumulation; FP32 operands use
  ``input_precision="ieee"`` (true FP32 FMA, never TF32).
* Epilogue in FP32 on the accumulator, then **one cast** to the execution dtype at the output.
  ``exp`` is a range-reduced polynomial written with IEEE ``+ - *`` and explicit ``fma`` (no
  ``ex2.approx``/``__expf``), divisions are Newton iterations in ``fma`` from an integer first
  guess with a final residual correction (no ``rcp.approx``/``div.full``), and kernels are compiled with
  ``enable_fp_fusion=False`` so no multiply-add is contracted: every epilogue operation is one
  IEEE-rounded FP32 operation, in the order written. The interpreter (numpy FP32) executes the same
  sequence.
* Backward: ``dZ = dY · epilogue'(Z)`` (elementwise), ``dX = dZ W`` by the same main kernel (W read
  as stored, ``(N, K)`` row-major), ``dW = Σ_s Σ_{rows of s} dZᵀ p(x)``, ``db = Σ_s Σ_rows dZ``: each
  sample s reduced over its own rows in ``BLOCK_M`` chunks from its first row (a tree that depends
  only on that sample's row count), the per-sample FP32 partials folded left in sample order
  (``acc = 0 + P_0; acc = acc + P_1; ...``), cast once. LoRA gradients use the same kernels.

Cast points (the only roundings to the execution dtype): the output ``y``; the saved pre-activation
``Z`` (when an epilogue is set and a gradient is needed); ``p(x)`` entering the tensor cores (BF16 only;
``silu`` is evaluated in FP32 from the stored x and rounded once, exactly as an unfused
``silu(x).to(dtype)`` would be); the LoRA intermediate ``u = p(x) Aᵀ`` (the engine's own output cast);
``dZ``; and each gradient output.

Weight layout: the forward reads nn.Linear's ``(N, K)`` weight in place (``"nk"``: tensor-descriptor
boxes transposed in shared memory before the dot, or strided pointer loads) or as a contiguous
``Wᵀ (K, N)`` copy owned by the weight tensor (``"kn"``, :mod:`.weights`), as
``configs.FWD[...].weight_layout`` says for the shape class; both feed the same values to the same
dots, so the choice changes speed and memory, never bytes.

Modules, in the order a call goes through them:

* :mod:`.codes` — the named activation codes (``Act``) shared by host code and kernels;
* :mod:`.fpmath` — the IEEE-only FP32 exp, division and activations the kernels inline;
* :mod:`.kernels` — the five Triton kernels and their grouped arguments (``FwdSpec``, ``DwSpec``);
* :mod:`.launch` — input checks, configuration lookup (``configs``), launches: ``gemm_fwd``,
  ``gemm_bwd``, ``gemm_dw``, ``gemm_db``, ``act_fwd``, ``act_bwd``;
* :mod:`.weights` — the weight-owned ``Wᵀ`` copy of the ``"kn"`` layout;
* :mod:`.cuda_context` — the primary-context workaround for descriptor encoding on autograd threads;
* :mod:`.autograd` — ``GemmFunction``, the public ``gemm``, the forward-only ``gemm_gate_residual`` (the product
  fused with the gated residual after it) and the registry entries.
"""

from __future__ import annotations

from .autograd import GEMM_OPS, GemmFunction, gemm, gemm_gate_residual, offer_gate_residual_fusion
from .codes import EPILOGUES, PROLOGUES, Act
from .launch import (
    DTYPES,
    interpreting,
    act_bwd,
    act_fwd,
    check_dtype_device,
    check_inputs,
    gemm_bwd,
    gemm_db,
    gemm_dw,
    gemm_fwd,
    launch_opts,
)
from .weights import drop_prepacked, prepacked_bytes, prepacked_weight

__all__ = [
    "EPILOGUES",
    "GEMM_OPS",
    "PROLOGUES",
    "DTYPES",
    "Act",
    "GemmFunction",
    "interpreting",
    "act_bwd",
    "act_fwd",
    "check_dtype_device",
    "check_inputs",
    "drop_prepacked",
    "gemm",
    "gemm_bwd",
    "gemm_gate_residual",
    "offer_gate_residual_fusion",
    "gemm_db",
    "gemm_dw",
    "gemm_fwd",
    "launch_opts",
    "prepacked_bytes",
    "prepacked_weight",
]

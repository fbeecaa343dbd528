"""Liger-Kernel (``liger-kernel``) where it has a kernel for one of our operators.

* adaLN modulation: ``LigerLayerNormFunction`` (weight 1, bias 0: Qwen-Image's LayerNorm has no affine)
  then the eager per-sample modulation ``x̂·(1 + scale) + shift``. Liger's ``LigerModulatedRMSNormFunction`` is
  a modulated *RMS*Norm, not the LayerNorm the model uses, so it is not a peer of this operator.
* QK-norm + RoPE: ``LigerRMSNormFunction`` per head (casting mode ``llama``) then ``LigerRopeFunction``.
  Liger rotates halves (``[x1, x2]``, HF Llama); Qwen-Image rotates interleaved pairs, so the adapter
  de-interleaves the normalised heads, rotates with tables ``[cos, cos]`` / ``[sin, sin]`` and interleaves
  back — the same function, with two copies around Liger's kernel.
* Projections, the gated residual and attention: Liger has no such kernel (its GEMMs are fused into losses,
  ``fused_add_rms_norm`` adds before a norm, its attention kernels are other operators).

Liger's kernels are Triton and run on a GPU only (the CPU's Triton interpreter stops inside them).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...kernels import production as P
from .cases import Case
from .impl import Impl, Missing

PEER = "liger-kernel"
_NONE = {"projection": "Liger-Kernel ships no standalone linear/GEMM kernel (its GEMMs are fused into loss functions)",
         "adaln_gate_residual": "Liger-Kernel has no gated-residual kernel (fused_add_rms_norm adds before a norm)",
         "attention": "Liger-Kernel has no joint (non-causal, varlen) attention kernel"}


def unavailable(device: str) -> str | None:
    """Why Liger cannot run here, or None."""
    try:
        import liger_kernel  # noqa: F401
    except ImportError as exc:
        return f"liger-kernel is not installed ({exc}); pip install '.[bench]'"
    if device != "cuda":
        return ("Liger-Kernel's Triton kernels need a CUDA device (under the CPU's Triton interpreter they stop with "
                "an InterpreterError in their kernels)")
    return None


def _modulation(eps: float):
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    def fn(x, shift, scale, *, seqlens):
        d = x.shape[-1]
        ones, zeros = torch.ones(d, dtype=x.dtype, device=x.device), torch.zeros(d, dtype=x.dtype, device=x.device)
        xh = LigerLayerNormFunction.apply(x, ones, zeros, eps)
        return (xh * (1 + P.per_row(scale, x, seqlens[0])) + P.per_row(shift, x, seqlens[0]),)

    return fn


def _qk_norm_rope(eps: float):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction

    def fn(x, c, s, gain, *, seqlens):
        m, h, d = x.shape
        y = LigerRMSNormFunction.apply(x.reshape(m * h, d), gain, eps, 0.0, "llama", False).view(m, h, d)
        halves = torch.cat([y[..., 0::2], y[..., 1::2]], dim=-1)  # interleaved pairs -> [re | im]
        q = halves.unsqueeze(0).transpose(1, 2)  # (1, H, M, d), Liger's layout
        k = torch.zeros(1, 1, m, d, dtype=x.dtype, device=x.device)
        cos, sin = torch.cat([c, c], -1).unsqueeze(0), torch.cat([s, s], -1).unsqueeze(0)
        qr, _ = LigerRopeFunction.apply(q, k, cos, sin)
        r = qr.transpose(1, 2).squeeze(0)  # (M, H, d) as [re | im]
        return (torch.stack([r[..., : d // 2], r[..., d // 2:]], dim=-1).flatten(-2),)

    return fn


def implementations(cases: Sequence[Case], device: str, dtype: torch.dtype) -> list[Impl | Missing]:
    """Liger's implementation of each case it has a kernel for; Missing (with the reason) for the rest."""
    why = unavailable(device)
    out: list[Impl | Missing] = []
    for case in cases:
        none = _NONE.get(case.op) or _NONE.get(case.family)
        if none or why:
            out.append(Missing(PEER, PEER, case.op, none or why or ""))
        elif case.op == "adaln_modulation":
            out.append(Impl(PEER, PEER, case.op, _modulation(case.config["eps"]),
                            "LigerLayerNormFunction (weight 1, bias 0) + eager modulation"))
        else:
            out.append(Impl(PEER, PEER, case.op, _qk_norm_rope(case.config["eps"]),
                            "LigerRMSNormFunction (llama casting) + LigerRopeFunction on de-interleaved pairs"))
    return out

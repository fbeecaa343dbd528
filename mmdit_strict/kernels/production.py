"""Production implementations (runtime ``off`` and ``auto`` fallback): plain PyTorch, one per operator.

cuBLAS / MKL GEMMs, SDPA attention and ATen norms: fast, not batch-invariant. Registered for every
operator on cpu and cuda in fp32 and bf16, never as strict.

These functions are the only production math of the model. They take either layout:

* **packed** (what the strict graph and ``auto`` fallbacks pass): rows ``(M, ...)`` of all samples
  back to back, ``seqlens`` rows per sample, per-sample vectors ``(B, D)`` gathered to their rows;
* **padded** (what ``runtime=off`` passes, as diffusers runs it): ``(B, T, ...)`` tensors with
  ``seqlens=None``, per-sample vectors ``(B, D)`` broadcast over ``T``.

The arithmetic per element is the same in both layouts (only the per-sample broadcast differs), so
a row gives the same bytes whichever layout carried it.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from ..dtypes import EXECUTION_DTYPES
import torch.nn.functional as F

from .cpu.primitives import row_sample_index
from .keepalive import retain
from .registry import KernelImpl, register

DTYPES = frozenset(EXECUTION_DTYPES)  # what the production backend registers for


def per_row(v: torch.Tensor, x: torch.Tensor, seqlens: Sequence[int] | None) -> torch.Tensor:
    """Per-sample vectors ``v (B, D)`` laid out against ``x``.

    Packed (``seqlens`` given): ``(M, D)``, sample ``b``'s vector repeated on its ``seqlens[b]`` rows
    (the row→sample index is cached per layout). Padded (``seqlens=None``, ``x`` is ``(B, T, ..., D)``):
    a broadcasting view ``(B, 1, ..., D)``.
    """
    if seqlens is None:
        if x.shape[0] != v.shape[0]:
            raise ValueError(f"padded layout: x has {x.shape[0]} samples but the per-sample vectors {v.shape[0]}")
        return v.reshape(v.shape[0], *([1] * (x.dim() - 2)), v.shape[-1])
    return v.index_select(0, row_sample_index(tuple(int(n) for n in seqlens), v.device))


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with diffusers' cast points: FP32 mean of squares, ``x·rsqrt`` in FP32,
    cast to the gain's dtype when that is half precision, then ``·gain`` (any leading shape)."""
    var = x.float().pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(var + eps)
    if gain.dtype in (torch.float16, torch.bfloat16):
        y = y.to(gain.dtype)
    return y * gain


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Affine-free LayerNorm over the last dim (ATen)."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps)


def apply_prologue(x: torch.Tensor, prologue: str) -> torch.Tensor:
    """The GEMM prologue: ``silu`` or ``none``."""
    if prologue == "silu":
        return F.silu(x)
    if prologue != "none":
        raise ValueError(f"unknown GEMM prologue {prologue!r} (none | silu)")
    return x


def apply_epilogue(z: torch.Tensor, epilogue: str) -> torch.Tensor:
    """The GEMM epilogue: ``gelu_tanh``, ``silu`` or ``none``."""
    if epilogue == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if epilogue == "silu":
        return F.silu(z)
    if epilogue != "none":
        raise ValueError(f"unknown GEMM epilogue {epilogue!r} (none | gelu_tanh | silu)")
    return z


def gemm(x, weight, bias=None, *, seqlens, prologue="none", epilogue="none", lora=None):
    """``epilogue(prologue(x) Wᵀ + b [+ scale·(prologue(x) Aᵀ) Bᵀ])`` over the last dim, any leading shape."""
    px = apply_prologue(x, prologue)
    z = F.linear(px, weight, bias)
    if lora is not None:
        a, b, scale = lora
        z = z + scale * F.linear(F.linear(px, a), b)
    return apply_epilogue(z, epilogue)


def adaln_modulation(x, shift, scale, *, seqlens, eps):
    """``LayerNorm(x)·(1 + scale) + shift`` with per-sample ``shift, scale (B, D)``."""
    return layer_norm(x, eps) * (1 + per_row(scale, x, seqlens)) + per_row(shift, x, seqlens)


def adaln_gate_residual(x, y, gate, *, seqlens):
    """``x + gate·y`` with per-sample ``gate (B, D)``."""
    return x + per_row(gate, y, seqlens) * y


def qk_rmsnorm(x, gain, *, seqlens, eps):
    """Per-head RMSNorm: ``x (..., H, d)``, gain ``(d,)``."""
    return rms_norm(x, gain, eps)


def txt_in_rmsnorm_linear(x, gain, weight, bias, *, seqlens, eps, lora=None):
    """``Linear(RMSNorm(x)·gain)``."""
    return gemm(rms_norm(x, gain, eps), weight, bias, seqlens=seqlens, lora=lora)


def final_adaln_out(x, temb, weight, bias, *, seqlens, eps, lora=None):
    """``scale, shift = Linear(SiLU(temb))``; ``LayerNorm(x)·(1 + scale) + shift``."""
    scale, shift = gemm(temb, weight, bias, seqlens=(1,) * temb.shape[0], prologue="silu", lora=lora).chunk(2, dim=-1)
    return adaln_modulation(x, shift, scale, seqlens=seqlens, eps=eps)


def timestep_sinusoid(sigma: torch.Tensor, channels: int, scale: float) -> torch.Tensor:
    """(B,) sigma → (B, channels) FP32 ``[cos | sin]`` of ``scale·sigma·10000^(-i/half)``."""
    half = channels // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=sigma.device) / half)
    args = scale * (sigma.float()[:, None] * freqs[None, :])
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def timestep_embed_mlp(sigma, w1, b1, w2, b2, *, channels, scale):
    """``Linear₂(SiLU(Linear₁(sinusoid(sigma))))``: (B,) → (B, D) in the weights' dtype."""
    emb = timestep_sinusoid(sigma, channels, scale).to(w1.dtype)
    return F.linear(F.silu(F.linear(emb, w1, b1)), w2, b2)


def multi_axis_rope(x, cos, sin):
    """Rotate interleaved pairs of ``x (..., H, d)`` by tables ``(..., d/2)`` (one per token); FP32 math."""
    pairs = x.float().unflatten(-1, (-1, 2))
    xr, xi = pairs[..., 0], pairs[..., 1]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.stack([xr * c - xi * s, xr * s + xi * c], dim=-1).flatten(-2).to(x.dtype)


def joint_attn_qk_gemm(q, k):
    return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])


def joint_attn_softmax(s):
    return torch.softmax(s, dim=-1)


def joint_attn_av_gemm(p, v):
    return p @ v


def joint_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA over padded ``(B, T, H, d)`` [text | image] sequences; ``key_mask (B, T)`` bool or None → ``(B, T, H·d)``."""
    mask = None if key_mask is None else key_mask[:, None, None, :]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return o.transpose(1, 2).flatten(2).to(q.dtype)


@functools.lru_cache(maxsize=64)
def _padded_key_mask(txt_lens: tuple[int, ...], Lt: int, Ti: int, device: torch.device) -> torch.Tensor:
    """(B, Lt + Ti) bool: the first ``txt_lens[b]`` text keys and every image key are valid; built once per layout."""
    lens = torch.tensor(txt_lens, device=device)
    txt_valid = torch.arange(Lt, device=device)[None, :] < lens[:, None]
    return torch.cat([txt_valid, txt_valid.new_ones(len(txt_lens), Ti)], dim=1)


def joint_attention_fused(q_txt, k_txt, v_txt, q_img, k_img, v_img, *, txt_seqlens, img_seqlens):
    """Joint [text, image] attention → ``(txt, img)`` outputs with heads flattened.

    Packed (``q_img (M, H, d)``): pads each sample to [max text | max image], attends with a key mask,
    unpacks. Padded (``q_img (B, Ti, H, d)``): ``txt_seqlens`` are the valid text tokens per sample
    (``None``: no text padding, no mask) and ``img_seqlens`` is ignored; one SDPA call, as diffusers.
    """
    if q_img.dim() == 4:
        Lt = q_txt.shape[1]
        mask = None
        if txt_seqlens is not None:
            mask = retain(_padded_key_mask(tuple(int(n) for n in txt_seqlens), Lt, q_img.shape[1], q_img.device))
        o = joint_sdpa(torch.cat([q_txt, q_img], 1), torch.cat([k_txt, k_img], 1), torch.cat([v_txt, v_img], 1), mask)
        return o[:, :Lt].contiguous(), o[:, Lt:].contiguous()
    B = len(txt_seqlens)
    Lt, Li = max(txt_seqlens), max(img_seqlens)
    H, d = q_img.shape[1:]

    def pad(txt, img):
        out = txt.new_zeros(B, Lt + Li, H, d)
        ts = is_ = 0
        for b, (nt, ni) in enumerate(zip(txt_seqlens, img_seqlens)):
            out[b, :nt] = txt[ts:ts + nt]
            out[b, Lt:Lt + ni] = img[is_:is_ + ni]
            ts, is_ = ts + nt, is_ + ni
        return out

    mask = torch.zeros(B, Lt + Li, dtype=torch.bool, device=q_img.device)
    for b, (nt, ni) in enumerate(zip(txt_seqlens, img_seqlens)):
        mask[b, :nt] = True
        mask[b, Lt:Lt + ni] = True
    o = joint_sdpa(pad(q_txt, q_img), pad(k_txt, k_img), pad(v_txt, v_img), mask)
    txt = torch.cat([o[b, :nt] for b, nt in enumerate(txt_seqlens)])
    img = torch.cat([o[b, Lt:Lt + ni] for b, ni in enumerate(img_seqlens)])
    return txt, img


_FNS = {
    "latent_proj_gemm": gemm, "qkv_bias_gemm": gemm, "attn_out_bias_gemm": gemm, "mlp_up_gemm_gelu": gemm,
    "mlp_down_gemm": gemm, "adaln_mod_projection": gemm, "adaln_modulation": adaln_modulation,
    "adaln_gate_residual": adaln_gate_residual, "qk_rmsnorm": qk_rmsnorm, "txt_in_rmsnorm_linear": txt_in_rmsnorm_linear,
    "final_adaln_out": final_adaln_out, "timestep_embed_mlp": timestep_embed_mlp, "multi_axis_rope": multi_axis_rope,
    "joint_attn_qk_gemm": joint_attn_qk_gemm, "joint_attn_softmax": joint_attn_softmax,
    "joint_attn_av_gemm": joint_attn_av_gemm, "joint_attention_fused": joint_attention_fused,
}
for _device in ("cpu", "cuda"):
    for _op, _fn in _FNS.items():
        register(KernelImpl(op=_op, backend="torch", device=_device, dtypes=DTYPES, fn=_fn, strict=False,
                            kernel_name=f"aten_{_fn.__name__}", reduction_order="library-chosen (not batch-invariant)",
                            accumulator="library"))

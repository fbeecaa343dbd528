"""Production implementations (runtime ``off`` and ``auto`` fallback): plain PyTorch, same signatures.

cuBLAS / MKL GEMMs, SDPA attention and ATen norms: fast, not batch-invariant. Registered for every
operator on cpu and cuda in fp32 and bf16, never as strict.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from .cpu.primitives import row_sample_index
from .registry import KernelImpl, register

_DTYPES = frozenset({torch.float32, torch.bfloat16})


def _rows(v: torch.Tensor, seqlens: Sequence[int]) -> torch.Tensor:
    # the row→sample index is cached per (seqlens, device): no host→device copy on a repeated layout
    return v.index_select(0, row_sample_index(tuple(int(n) for n in seqlens), v.device))


def gemm(x, weight, bias=None, *, seqlens, prologue="none", epilogue="none", lora=None):
    px = F.silu(x) if prologue == "silu" else x
    z = F.linear(px, weight, bias)
    if lora is not None:
        a, b, scale = lora
        z = z + scale * F.linear(F.linear(px, a), b)
    if epilogue == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if epilogue == "silu":
        return F.silu(z)
    return z


def adaln_modulation(x, shift, scale, *, seqlens, eps):
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + _rows(scale, seqlens)) + _rows(shift, seqlens)


def adaln_gate_residual(x, y, gate, *, seqlens):
    return x + _rows(gate, seqlens) * y


def qk_rmsnorm(x, gain, *, seqlens, eps):
    return F.rms_norm(x, (x.shape[-1],), gain, eps=eps)


def txt_in_rmsnorm_linear(x, gain, weight, bias, *, seqlens, eps, lora=None):
    return gemm(F.rms_norm(x, (x.shape[-1],), gain, eps=eps), weight, bias, seqlens=seqlens, lora=lora)


def final_adaln_out(x, temb, weight, bias, *, seqlens, eps, lora=None):
    scale, shift = gemm(temb, weight, bias, seqlens=(1,) * temb.shape[0], prologue="silu", lora=lora).chunk(2, dim=-1)
    return adaln_modulation(x, shift, scale, seqlens=seqlens, eps=eps)


def timestep_embed_mlp(sigma, w1, b1, w2, b2, *, channels, scale):
    half = channels // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=sigma.device) / half)
    args = scale * (sigma.float()[:, None] * freqs[None, :])
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(w1.dtype)
    return F.linear(F.silu(F.linear(emb, w1, b1)), w2, b2)


def multi_axis_rope(x, cos, sin):
    pairs = x.float().unflatten(-1, (-1, 2))
    xr, xi = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([xr * c - xi * s, xr * s + xi * c], dim=-1).flatten(-2).to(x.dtype)


def joint_attn_qk_gemm(q, k):
    return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])


def joint_attn_softmax(s):
    return torch.softmax(s, dim=-1)


def joint_attn_av_gemm(p, v):
    return p @ v


def joint_attention_fused(q_txt, k_txt, v_txt, q_img, k_img, v_img, *, txt_seqlens, img_seqlens):
    """Padded SDPA with a key mask, like diffusers: pack → pad → attend → unpack."""
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
        return out.transpose(1, 2)

    mask = torch.zeros(B, Lt + Li, dtype=torch.bool, device=q_img.device)
    for b, (nt, ni) in enumerate(zip(txt_seqlens, img_seqlens)):
        mask[b, :nt] = True
        mask[b, Lt:Lt + ni] = True
    o = F.scaled_dot_product_attention(pad(q_txt, q_img), pad(k_txt, k_img), pad(v_txt, v_img), attn_mask=mask[:, None, None, :])
    o = o.transpose(1, 2).flatten(2)
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
        register(KernelImpl(op=_op, backend="torch", device=_device, dtypes=_DTYPES, fn=_fn, strict=False,
                            kernel_name=f"aten_{_fn.__name__}", reduction_order="library-chosen (not batch-invariant)",
                            accumulator="library"))

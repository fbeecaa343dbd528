"""Parameter containers of the Qwen-Image MMDiT with diffusers' module names.

The module tree (and therefore the state-dict keys) is identical to diffusers'
``QwenImageTransformer2DModel``, so checkpoints load without renaming and PEFT target names carry
over. Each module's ``forward`` is the production (runtime ``off``) math in plain PyTorch; the strict
runtime reads the same parameters and calls registry operators instead (see ``strict.py``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config.arch import ArchConfig


def timestep_sinusoid(sigma: torch.Tensor, channels: int, scale: float) -> torch.Tensor:
    """(B,) sigma → (B, channels) FP32 ``[cos | sin]`` of ``scale·sigma·10000^(-i/half)``."""
    half = channels // 2
    exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=sigma.device) / half
    args = scale * (sigma.float()[:, None] * torch.exp(exponent)[None, :])
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learned gain (diffusers ``RMSNorm(dim, eps)``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same cast points as diffusers: FP32 statistics, half-precision gain product when the gain is half.
        var = x.float().pow(2).mean(-1, keepdim=True)
        y = x * torch.rsqrt(var + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            y = y.to(self.weight.dtype)
        return y * self.weight


class TimestepEmbedding(nn.Module):
    """``linear_1`` (256→D) → SiLU → ``linear_2`` (D→D)."""

    def __init__(self, in_channels: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeTextEmbed(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.channels = cfg.timestep_channels
        self.scale = cfg.timestep_scale
        self.timestep_embedder = TimestepEmbedding(cfg.timestep_channels, cfg.hidden_size)

    def forward(self, sigma: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.timestep_embedder(timestep_sinusoid(sigma, self.channels, self.scale).to(dtype))  # (B, D)


class GELUProj(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """``net.0.proj`` (D→4D, tanh-GELU) → ``net.2`` (4D→D)."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([GELUProj(dim, inner), nn.Dropout(0.0), nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
        return x


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x (B, T, H, d)`` by tables ``(B, T, d/2)``; FP32 math."""
    xf = x.float().unflatten(-1, (-1, 2))
    xr, xi = xf[..., 0], xf[..., 1]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = torch.stack([xr * c - xi * s, xr * s + xi * c], dim=-1).flatten(-2)
    return out.to(x.dtype)


class JointAttention(nn.Module):
    """Joint [text, image] attention with separate per-stream projections and per-head QK RMSNorm."""

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.attention_head_dim
        self.to_q, self.to_k, self.to_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.add_q_proj, self.add_k_proj, self.add_v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.norm_q = RMSNorm(cfg.attention_head_dim, cfg.eps)
        self.norm_k = RMSNorm(cfg.attention_head_dim, cfg.eps)
        self.norm_added_q = RMSNorm(cfg.attention_head_dim, cfg.eps)
        self.norm_added_k = RMSNorm(cfg.attention_head_dim, cfg.eps)
        self.to_out = nn.ModuleList([nn.Linear(d, d), nn.Dropout(0.0)])
        self.to_add_out = nn.Linear(d, d)

    def forward(
        self,
        img: torch.Tensor,  # (B, Ti, D)
        txt: torch.Tensor,  # (B, Tt, D)
        txt_mask: torch.Tensor | None,  # (B, Tt) bool
        rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        img_cos, img_sin, txt_cos, txt_sin = rope
        split = lambda t: t.unflatten(-1, (self.heads, self.head_dim))  # noqa: E731
        iq, ik, iv = split(self.to_q(img)), split(self.to_k(img)), split(self.to_v(img))
        tq, tk, tv = split(self.add_q_proj(txt)), split(self.add_k_proj(txt)), split(self.add_v_proj(txt))
        iq, ik = apply_rope(self.norm_q(iq), img_cos, img_sin), apply_rope(self.norm_k(ik), img_cos, img_sin)
        tq, tk = apply_rope(self.norm_added_q(tq), txt_cos, txt_sin), apply_rope(self.norm_added_k(tk), txt_cos, txt_sin)
        q = torch.cat([tq, iq], dim=1).transpose(1, 2)  # (B, H, T, d)
        k = torch.cat([tk, ik], dim=1).transpose(1, 2)
        v = torch.cat([tv, iv], dim=1).transpose(1, 2)
        mask = None
        if txt_mask is not None:
            full = torch.cat([txt_mask, txt_mask.new_ones(img.shape[0], img.shape[1])], dim=1)
            mask = full[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2).to(q.dtype)
        tt = txt.shape[1]
        return self.to_out[0](out[:, tt:].contiguous()), self.to_add_out(out[:, :tt].contiguous())


class DoubleStreamBlock(nn.Module):
    """One MMDiT block: per-stream AdaLN modulation, joint attention, gated residuals, per-stream MLP."""

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.eps = cfg.eps
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.attn = JointAttention(cfg)
        self.img_mlp = FeedForward(d, cfg.mlp_hidden)
        self.txt_mlp = FeedForward(d, cfg.mlp_hidden)

    def _ln(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), eps=self.eps)

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        txt_mask: torch.Tensor | None,
        temb: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # (shift, scale, gate) × (attention, MLP), each (B, 1, D)
        i_sh1, i_sc1, i_g1, i_sh2, i_sc2, i_g2 = self.img_mod(temb)[:, None, :].chunk(6, dim=-1)
        t_sh1, t_sc1, t_g1, t_sh2, t_sc2, t_g2 = self.txt_mod(temb)[:, None, :].chunk(6, dim=-1)
        img_attn, txt_attn = self.attn(
            self._ln(img) * (1 + i_sc1) + i_sh1, self._ln(txt) * (1 + t_sc1) + t_sh1, txt_mask, rope
        )
        img = img + i_g1 * img_attn
        txt = txt + t_g1 * txt_attn
        img = img + i_g2 * self.img_mlp(self._ln(img) * (1 + i_sc2) + i_sh2)
        txt = txt + t_g2 * self.txt_mlp(self._ln(txt) * (1 + t_sc2) + t_sh2)
        return img, txt


class AdaNormOut(nn.Module):
    """Final image-stream modulation: ``scale, shift = Linear(SiLU(temb))``; LayerNorm·(1+scale)+shift."""

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.eps = cfg.eps
        self.linear = nn.Linear(cfg.hidden_size, 2 * cfg.hidden_size)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb)).chunk(2, dim=-1)
        return F.layer_norm(x, (x.shape[-1],), eps=self.eps) * (1 + scale)[:, None, :] + shift[:, None, :]

"""Independent FP64 CPU references for the sampling math (sigma table, CFG, SDE/Euler step, KL, latents).

Written from docs/design.md §2 for clarity, not speed, and sharing no code with :mod:`mmdit_strict.sampling`
(no fixed trees, no FP32 rounding choices): every input is promoted to float64 on the CPU and the
formulas are evaluated in their textbook form. Tests compare the FP32 strict implementations to these
within the tolerances declared in ``tolerances.yaml`` (section ``sampling``).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = [
    "ref_mu",
    "ref_sigma_table",
    "ref_cfg_combine",
    "ref_sde_step",
    "ref_euler_step",
    "ref_gaussian_kl",
    "ref_normalize_latents",
    "ref_denormalize_latents",
    "ref_pack_latents",
    "ref_unpack_latents",
    "diffusers_cfg_formula_fp32",
]

F64 = torch.float64


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", F64)


def _per_sample(value, batch: int) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        value = _f64(value).reshape(-1)
        return value.expand(batch).clone() if value.numel() == 1 else value
    return torch.full((batch,), float(value), dtype=F64)


def ref_mu(image_seq_len: int, base_seq_len=256, max_seq_len=8192, base_shift=0.5, max_shift=0.9) -> float:
    """mu = base_shift + (max_shift - base_shift) * (L - base_seq_len) / (max_seq_len - base_seq_len)."""
    return base_shift + (max_shift - base_shift) * (image_seq_len - base_seq_len) / (max_seq_len - base_seq_len)


def ref_sigma_table(num_steps: int, image_seq_len: int, shift_terminal: float = 0.02, **mu_kwargs) -> torch.Tensor:
    """FP64 sigma table: exponential shift of linspace(1, 1/N, N), stretched so entry N-1 is shift_terminal, then 0."""
    mu = ref_mu(image_seq_len, **mu_kwargs)
    out = []
    for i in range(num_steps):
        t = 1.0 - i * (1.0 - 1.0 / num_steps) / (num_steps - 1) if num_steps > 1 else 1.0
        out.append(math.exp(mu) / (math.exp(mu) + (1.0 / t - 1.0)))
    if num_steps > 1 and shift_terminal:
        last = 1.0 - out[-1]
        out = [1.0 - (1.0 - s) * (1.0 - shift_terminal) / last for s in out]
    return torch.tensor(out + [0.0], dtype=F64)


def ref_cfg_combine(cond: torch.Tensor, neg: torch.Tensor, scale: float) -> torch.Tensor:
    """FP64: (neg + s (cond - neg)) * ||cond|| / ||comb|| per token (norms over the last dim)."""
    c, n = _f64(cond), _f64(neg)
    comb = n + scale * (c - n)
    nc = c.pow(2).sum(-1, keepdim=True).sqrt()
    nm = comb.pow(2).sum(-1, keepdim=True).sqrt()
    return comb * nc / nm


def ref_sde_step(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma,
    sigma_prev,
    *,
    sigma_max: float,
    eta: float = 0.7,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """FP64 Flow-GRPO SDE step. Returns ``{"x_prev", "logp", "mean", "std"}`` (std without sqrt(-dt))."""
    vv, xx = _f64(v), _f64(x)
    b = xx.shape[0]
    bshape = (b,) + (1,) * (xx.dim() - 1)
    s = _per_sample(sigma, b)
    sp = _per_sample(sigma_prev, b)
    smax = float(sigma_max)
    dt = (sp - s).view(bshape)
    std = torch.stack([torch.tensor(math.sqrt(si / (1.0 - (smax if si == 1.0 else si))) * eta, dtype=F64) for si in s.tolist()])
    sd = std.view(bshape)
    sg = s.view(bshape)
    mean = xx + (sd**2 / (2 * sg)) * dt * xx + vv * dt + vv * dt * sd**2 * (1 - sg) / (2 * sg)
    scale = sd * torch.sqrt(-dt)
    x_prev = mean + scale * _f64(noise) if noise is not None else _f64(prev_sample)
    z = (x_prev - mean) / scale
    elem = -0.5 * z**2 - torch.log(scale) - 0.5 * math.log(2 * math.pi)
    logp = elem.reshape(b, -1).mean(dim=1)
    return {"x_prev": x_prev, "logp": logp, "mean": mean, "std": std}


def ref_euler_step(v: torch.Tensor, x: torch.Tensor, sigma, sigma_prev) -> torch.Tensor:
    """FP64 x + (sigma_prev - sigma) v."""
    xx = _f64(x)
    b = xx.shape[0]
    dt = (_per_sample(sigma_prev, b) - _per_sample(sigma, b)).view((b,) + (1,) * (xx.dim() - 1))
    return xx + dt * _f64(v)


def ref_gaussian_kl(mean_a: torch.Tensor, mean_b: torch.Tensor, std) -> torch.Tensor:
    """FP64 mean over elements of (a - b)^2 / (2 std^2) per sample."""
    a, b_ = _f64(mean_a), _f64(mean_b)
    sd = _per_sample(std, a.shape[0])
    return ((a - b_) ** 2).reshape(a.shape[0], -1).mean(dim=1) / (2 * sd**2)


def ref_normalize_latents(z: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """FP64 (z - mean_c) / std_c with the channel on dim 1."""
    zz = _f64(z)
    shape = (1, -1) + (1,) * (zz.dim() - 2)
    return (zz - torch.tensor(list(mean), dtype=F64).view(shape)) / torch.tensor(list(std), dtype=F64).view(shape)


def ref_denormalize_latents(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """FP64 x * std_c + mean_c with the channel on dim 1."""
    xx = _f64(x)
    shape = (1, -1) + (1,) * (xx.dim() - 2)
    return xx * torch.tensor(list(std), dtype=F64).view(shape) + torch.tensor(list(mean), dtype=F64).view(shape)


def _packed_positions(c: int, h: int, w: int):
    """Every (token, its 4c-wide slots of one 2x2 offset, latent row, latent column) of the 2x2 packing:
    token i*(w/2)+j, slots 4ch + 2dy + dx over the channels ch, pixel (2i+dy, 2j+dx)."""
    for i in range(h // 2):
        for j in range(w // 2):
            for dy in range(2):
                for dx in range(2):
                    yield i * (w // 2) + j, [4 * ch + 2 * dy + dx for ch in range(c)], 2 * i + dy, 2 * j + dx


def ref_pack_latents(z: torch.Tensor) -> torch.Tensor:
    """Index-by-index 2x2 packing: out[b, i*(W/2)+j, 4c + 2dy + dx] = z[b, c, 2i+dy, 2j+dx] (dtype kept)."""
    b, c, h, w = z.shape
    out = torch.empty((b, (h // 2) * (w // 2), 4 * c), dtype=z.dtype)
    src = z.detach().cpu()
    for tok, slots, y, x in _packed_positions(c, h, w):
        out[:, tok, slots] = src[:, :, y, x]
    return out


def ref_unpack_latents(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Index-by-index inverse of :func:`ref_pack_latents`."""
    b, _, packed = x.shape
    c = packed // 4
    out = torch.empty((b, c, height, width), dtype=x.dtype)
    src = x.detach().cpu()
    for tok, slots, y, px in _packed_positions(c, height, width):
        out[:, :, y, px] = src[:, tok, slots]
    return out


def diffusers_cfg_formula_fp32(cond: torch.Tensor, neg: torch.Tensor, scale: float) -> torch.Tensor:
    """The guidance expression ``QwenImagePipeline.__call__`` evaluates inline (same dtype, ``torch.norm``).

    diffusers exposes it only inside the sampling loop, so the parity tests need it as a callable:
    ``comb = neg + s * (cond - neg)``; ``comb * (||cond|| / ||comb||)`` with ``torch.norm`` over the last dim.
    """
    comb = neg + scale * (cond - neg)
    return comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))

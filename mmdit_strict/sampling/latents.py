"""Latent layout: per-channel normalisation (``latent_normalize``) and 2x2 packing (``latent_pack_unpack``).

Normalisation (docs/design.md §2, diffusers' ``QwenImagePipeline``; FP32, elementwise, no reductions):

    std_inv = fp32(1) / fp32(std)               per channel, computed once on the CPU
    normalize(z)   = (z - mean) * std_inv       channels on dim 1 of (B, C, H, W) or (B, C, F, H, W)
    denormalize(x) = x / std_inv + mean         (exactly the decode path of the pipeline)

The round trip is not exact in FP32 (two roundings each way); its bound is the declared tolerance
``sampling.normalize_roundtrip``.

Packing (pure data movement, byte-exact; the inverse is exact):

    pack:   (B, C, H, W) -> view (B, C, H/2, 2, W/2, 2) -> permute(0, 2, 4, 1, 3, 5) -> (B, H/2 * W/2, 4C)
    unpack: (B, H/2 * W/2, 4C) -> view (B, H/2, W/2, C, 2, 2) -> permute(0, 3, 1, 4, 2, 5) -> (B, C, H, W)

Token ``i * (W/2) + j`` holds channel-major ``[c, dy, dx]`` values of the 2x2 patch at ``(2i, 2j)``.
``H`` and ``W`` are latent-grid sizes (image pixels / 8), both even. The VAE wants ``(B, C, 1, H, W)``:
``unpack_latents(...).unsqueeze(2)``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._register import register_sampling_op

__all__ = ["normalize_latents", "denormalize_latents", "pack_latents", "unpack_latents"]



def _channel_constants(name: str, values: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Per-channel constants → (C,) FP32 CPU tensor (Python floats rounded once, as ``torch.tensor`` does)."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or not values.is_floating_point():
            raise ValueError(f"{name} must be a 1-D float tensor of per-channel values, got {values.dtype} shape {tuple(values.shape)}")
        out = values.detach().to("cpu", torch.float32)
    else:
        try:
            out = torch.tensor([float(v) for v in values], dtype=torch.float32)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name} must be a sequence of floats or a 1-D float tensor: {exc}") from None
    if out.numel() == 0:
        raise ValueError(f"{name} is empty")
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"{name} contains NaN or Inf")
    return out


def _check_latents(name: str, z: torch.Tensor, channels: int) -> None:
    if not isinstance(z, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(z).__name__}")
    if z.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {z.dtype}")
    if z.dim() not in (4, 5):
        raise ValueError(f"{name} must have shape (B, C, H, W) or (B, C, F, H, W), got {tuple(z.shape)}")
    if z.shape[1] != channels:
        raise ValueError(f"{name} has {z.shape[1]} channels on dim 1, but {channels} per-channel constants were given")


def _prepare(z: torch.Tensor, mean, std, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    mean_t = _channel_constants("mean", mean)
    std_t = _channel_constants("std", std)
    if mean_t.numel() != std_t.numel():
        raise ValueError(f"mean has {mean_t.numel()} channels but std has {std_t.numel()}")
    if bool((std_t == 0).any()):
        raise ValueError("std contains a zero")
    _check_latents(name, z, mean_t.numel())
    std_inv = torch.tensor(1.0, dtype=torch.float32) / std_t
    shape = (1, -1) + (1,) * (z.dim() - 2)
    return mean_t.to(z.device).view(shape), std_inv.to(z.device).view(shape)


def normalize_latents(z: torch.Tensor, mean: Sequence[float] | torch.Tensor, std: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """VAE latents → model latents: ``(z - mean) * (1 / std)`` per channel.

    Args:
        z: ``(B, C, H, W)`` or ``(B, C, F, H, W)`` FP32.
        mean, std: ``C`` per-channel constants (the VAE config's ``latents_mean`` / ``latents_std``).

    Returns:
        FP32 tensor of ``z``'s shape.
    """
    mean_v, std_inv_v = _prepare(z, mean, std, "z")
    return (z - mean_v) * std_inv_v


def denormalize_latents(x: torch.Tensor, mean: Sequence[float] | torch.Tensor, std: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Model latents → VAE latents: ``x / (1 / std) + mean`` per channel (diffusers' decode arithmetic).

    Args:
        x: ``(B, C, H, W)`` or ``(B, C, F, H, W)`` FP32.
        mean, std: ``C`` per-channel constants.

    Returns:
        FP32 tensor of ``x``'s shape.
    """
    mean_v, std_inv_v = _prepare(x, mean, std, "x")
    return x / std_inv_v + mean_v


def pack_latents(z: torch.Tensor) -> torch.Tensor:
    """``(B, C, H, W)`` → ``(B, (H/2) * (W/2), 4C)`` 2x2 patch tokens (diffusers' ``_pack_latents``).

    Any dtype; pure data movement. ``H`` and ``W`` must be even.
    """
    if not isinstance(z, torch.Tensor):
        raise TypeError(f"z must be a torch.Tensor, got {type(z).__name__}")
    if z.dim() != 4:
        hint = " (squeeze the frame dim: z.squeeze(2))" if z.dim() == 5 and z.shape[2] == 1 else ""
        raise ValueError(f"pack_latents expects z of shape (B, C, H, W), got {tuple(z.shape)}{hint}")
    b, c, h, w = z.shape
    if h % 2 or w % 2:
        raise ValueError(f"latent height and width must be even for 2x2 packing, got H={h} W={w}")
    patches = z.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``(B, (H/2) * (W/2), 4C)`` → ``(B, C, H, W)``: the exact inverse of :func:`pack_latents`.

    Args:
        x: packed tokens, any dtype.
        height, width: the latent grid ``H``, ``W`` (image pixels / 8), both even.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"unpack_latents expects x of shape (B, tokens, 4C), got {tuple(x.shape)}")
    for name, val in (("height", height), ("width", width)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 2 or val % 2:
            raise ValueError(f"{name} must be an even int >= 2 (latent grid size), got {val!r}")
    b, tokens, packed = x.shape
    if tokens != (height // 2) * (width // 2):
        raise ValueError(
            f"x has {tokens} tokens but a {height}x{width} latent grid packs to {(height // 2) * (width // 2)}"
        )
    if packed % 4:
        raise ValueError(f"packed channel count must be a multiple of 4, got {packed}")
    c = packed // 4
    patches = x.reshape(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, c, height, width)


register_sampling_op("latent_pack_unpack", pack_latents, "mmdit_strict.sampling.latents.pack_latents/unpack_latents",
                     "none (data movement)", config={"inverse": "mmdit_strict.sampling.latents.unpack_latents"})
register_sampling_op("latent_normalize", normalize_latents, "mmdit_strict.sampling.latents.normalize_latents/denormalize_latents",
                     "none (elementwise FP32)", config={"inverse": "mmdit_strict.sampling.latents.denormalize_latents"})

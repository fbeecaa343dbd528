"""Pictures to packed latents: VAE encode (the inverse direction of ``pipelines.vae.decode``).

What a batch of images becomes, step by step (diffusers' ``QwenImageImg2ImgPipeline`` path:
``image_processor.preprocess`` → ``_encode_vae_image`` → ``_pack_latents``):

1. ``(B, H, W, 3)`` uint8 → ``x / 255`` in FP32, channels first; ``(B, 3, H, W)`` float in ``[0, 1]``
   is taken as it is (its dtype kept);
2. ``2 · x - 1`` → ``[-1, 1]`` (``VaeImageProcessor.normalize``), cast to the VAE's dtype, frame dim
   added: ``(B, 3, 1, H, W)``;
3. ``AutoencoderKLQwenImage.encode(x).latent_dist`` and its mode (``sample_mode="argmax"``, as the
   edit pipelines retrieve it) or a draw ``mean + std · randn`` from a caller's generator
   (``sample_mode="sample"``, the img2img pipeline's default): ``(B, 16, 1, H/8, W/8)``;
4. per channel ``(z - mean) · (1 / std)`` with the VAE config's ``latents_mean`` / ``latents_std``
   (``1 / std`` rounded to the latent dtype first);
5. frame dim dropped and 2x2 patches packed: ``(B, (H/16)·(W/16), 64)``, the layout the transformer
   reads and ``pipelines.vae.decode`` takes back with ``grid = (H // 16, W // 16)``.

Strict and production parts. Steps 4 and 5 are the sampling operators ``latent_normalize`` and
``latent_pack_unpack`` (FP32 eager; the packing is pure data movement in any dtype), so an FP32 VAE's
latents are normalized by the strict operator, byte-equal to diffusers' FP32 arithmetic. A VAE in
another dtype (BF16) is normalized with diffusers' arithmetic in that dtype: production. Steps 1-2
are elementwise and exact to diffusers' bytes. Step 3 is diffusers' VAE network: production, with no
batch-invariance or cross-machine promise (its convolutions are whatever the backend picks).

Diffusers' own pipelines disagree on step 4's last bit: the img2img, inpaint and controlnet
pipelines multiply by ``1 / std`` (what this module does, and the exact inverse arithmetic of the
text-to-image decode), the edit pipelines divide by ``std``; the two can differ by one rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..sampling.latents import pack_latents
from .vae import normalize

SAMPLE_MODES = ("argmax", "sample")
PIXELS_PER_TOKEN = 16  # 8x VAE downsampling, then 2x2 packing


def to_vae_input(images: torch.Tensor | np.ndarray, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """Steps 1-2: ``(B, H, W, 3)`` uint8 or ``(B, 3, H, W)`` float in ``[0, 1]`` → ``(B, 3, 1, H, W)`` in ``[-1, 1]``.

    Raises ValueError for a wrong shape or dtype, values outside ``[0, 1]``, NaN / Inf, or sides
    that are not positive multiples of 16.
    """
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(images)
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"images must be a torch.Tensor or numpy array, got {type(images).__name__}")
    if images.dtype == torch.uint8:
        if images.dim() != 4 or images.shape[3] != 3:
            raise ValueError(f"uint8 images must have shape (B, H, W, 3), got {tuple(images.shape)}")
        x = images.permute(0, 3, 1, 2).to(torch.float32) / 255.0  # (B, 3, H, W)
    elif images.is_floating_point():
        if images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"float images must have shape (B, 3, H, W), got {tuple(images.shape)}")
        if not bool(torch.isfinite(images).all()):
            raise ValueError("float images contain NaN or Inf")
        lo, hi = float(images.min()), float(images.max())
        if lo < 0 or hi > 1:
            raise ValueError(f"float images must lie in [0, 1], got values in [{lo}, {hi}]")
        x = images
    else:
        raise ValueError(f"images must be uint8 (B, H, W, 3) or float (B, 3, H, W) in [0, 1], got {images.dtype}")
    if x.shape[0] == 0:
        raise ValueError("images hold no image (B = 0)")
    H, W = x.shape[2], x.shape[3]
    if H < PIXELS_PER_TOKEN or W < PIXELS_PER_TOKEN or H % PIXELS_PER_TOKEN or W % PIXELS_PER_TOKEN:
        raise ValueError(f"image height and width must be positive multiples of {PIXELS_PER_TOKEN} "
                         f"(8x VAE, then 2x2 packing), got H={H} W={W}")
    x = 2.0 * x - 1.0
    return x.to(device=device, dtype=dtype).unsqueeze(2)


@torch.no_grad()
def encode(vae: Any, images: torch.Tensor | np.ndarray, *, sample_mode: str = "argmax",
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Encode images with an ``AutoencoderKLQwenImage`` (steps 1-5 of the module docstring).

    Args:
        vae: diffusers' ``AutoencoderKLQwenImage`` (any device and dtype; FP32 keeps steps 4-5 strict).
        images: ``(B, H, W, 3)`` uint8, or ``(B, 3, H, W)`` float in ``[0, 1]``; ``H``, ``W`` multiples of 16.
        sample_mode: ``"argmax"`` (the posterior's mode, no randomness) or ``"sample"`` (one draw).
        generator: the ``torch.Generator`` of the draw, required by ``"sample"`` (on the VAE's device),
            refused by ``"argmax"``: a draw never comes from the global RNG.

    Returns:
        Packed latents ``(B, (H/16)·(W/16), 64)`` in the VAE's dtype, on its device.
    """
    if sample_mode not in SAMPLE_MODES:
        raise ValueError(f"sample_mode must be one of {SAMPLE_MODES}, got {sample_mode!r}")
    if sample_mode == "sample" and not isinstance(generator, torch.Generator):
        raise ValueError("sample_mode='sample' needs a torch.Generator (draws never use the global RNG)")
    if sample_mode == "argmax" and generator is not None:
        raise ValueError("sample_mode='argmax' takes no generator (the mode is not random)")
    cfg = vae.config
    x = to_vae_input(images, vae.dtype, vae.device)  # (B, 3, 1, H, W)
    dist = vae.encode(x).latent_dist
    z = dist.mode() if sample_mode == "argmax" else dist.sample(generator)  # (B, 16, 1, H/8, W/8)
    if z.dim() != 5 or z.shape[1] != int(cfg.z_dim) or z.shape[2] != 1:
        raise ValueError(f"the VAE returned latents of shape {tuple(z.shape)}, expected (B, {cfg.z_dim}, 1, h, w)")
    z = normalize(z, cfg.latents_mean, cfg.latents_std)
    return pack_latents(z[:, :, 0])

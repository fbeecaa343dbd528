"""Final latents to pictures: VAE decode (the Phase B VAE contract), a fixed preview without a VAE,
and a contact sheet for the report.

Decode follows ``QwenImagePipeline``'s last steps exactly:

1. unpack ``(B, h·w, 64)`` tokens into ``(B, 16, 1, 2h, 2w)`` latents (each token is a 2×2 patch of
   16 channels, channel-major);
2. denormalize with the VAE's statistics: ``z / (1 / std) + mean`` (``1 / std`` rounded to the
   latent dtype first, as diffusers does);
3. ``AutoencoderKLQwenImage.decode`` and take frame 0: ``(B, 3, 16h, 16w)`` in ``[-1, 1]``;
4. map to ``[0, 1]`` (``x / 2 + 0.5``, clamped) and round ``x · 255`` to 8-bit RGB.

Strict and production parts. Steps 1 and 2 are the sampling operators ``latent_pack_unpack``
and ``latent_normalize`` (FP32 eager, byte-equal to diffusers' FP32 arithmetic; the unpack is pure
data movement in any dtype). A VAE held in another dtype (BF16) is denormalized with diffusers'
arithmetic in that dtype (mean and ``1 / std`` rounded to it first): production, not a strict
operator. Step 3 is diffusers' VAE network itself, always production. :func:`normalize` is step 2's
inverse, used by the encode path (``pipelines.vae_encode``).

Without a VAE, :func:`preview_rgb` projects the 16 latent channels on a fixed 16×3 matrix (drawn once
from seed 0, unit columns; not colour-calibrated) and squashes with tanh: the layout of an image,
not its colours, identical for identical latents on every machine.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..sampling.latents import denormalize_latents, normalize_latents
from ..sampling.latents import unpack_latents as unpack_grid

logger = logging.getLogger(__name__)


def unpack_latents(packed: torch.Tensor, grid: tuple[int, int], channels: int = 16) -> torch.Tensor:
    """``(B, h·w, channels·4)`` packed tokens → ``(B, channels, 1, 2h, 2w)`` latents (diffusers' order).

    ``grid`` is the token grid ``(h, w)`` (image pixels / 16); the data movement is the strict
    ``latent_pack_unpack`` operator's, with the VAE's frame dim added.
    """
    h, w = (int(g) for g in grid)
    if packed.dim() != 3 or packed.shape[1] != h * w or packed.shape[2] != channels * 4:
        raise ValueError(f"expected packed latents of shape (B, {h * w}, {channels * 4}) for grid {grid}, "
                         f"got {tuple(packed.shape)}")
    return unpack_grid(packed, 2 * h, 2 * w).unsqueeze(2)


def _stats_in(latents: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Production: ``mean`` and ``1 / std`` as diffusers makes them, in the latents' dtype and device."""
    C = latents.shape[1]
    if len(mean) != C or len(std) != C:
        raise ValueError(f"need {C} latent means and stds, got {len(mean)} and {len(std)}")
    m = torch.tensor(list(mean)).view(1, C, 1, 1, 1).to(latents.device, latents.dtype)
    inv = 1.0 / torch.tensor(list(std)).view(1, C, 1, 1, 1).to(latents.device, latents.dtype)
    return m, inv


def denormalize(latents: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``latents / (1 / std) + mean`` per channel of ``(B, C, F, H, W)`` latents, in their dtype.

    FP32: the strict ``denormalize_latents``. Other dtypes: diffusers' arithmetic in that dtype (production).
    """
    if latents.dtype == torch.float32:
        return denormalize_latents(latents, mean, std)
    m, inv = _stats_in(latents, mean, std)
    return latents / inv + m


def normalize(latents: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``(latents - mean) * (1 / std)`` per channel of ``(B, C, F, H, W)`` latents, in their dtype.

    FP32: the strict ``normalize_latents``. Other dtypes: diffusers' arithmetic in that dtype (production).
    """
    if latents.dtype == torch.float32:
        return normalize_latents(latents, mean, std)
    m, inv = _stats_in(latents, mean, std)
    return (latents - m) * inv


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """``(B, 3, H, W)`` in ``[-1, 1]`` → ``(B, H, W, 3)`` uint8 (``round(255 · clamp(x / 2 + 0.5))``)."""
    x = (images.float() / 2 + 0.5).clamp(0, 1)
    return (x.permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)


@torch.no_grad()
def decode_to_images(vae: Any, packed: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Steps 1-3 with an ``AutoencoderKLQwenImage``: packed final latents → ``(B, 3, 16h, 16w)`` in ``[-1, 1]``
    (the VAE's dtype and device)."""
    cfg = vae.config
    z = unpack_latents(packed.to(device=vae.device, dtype=vae.dtype), grid, int(cfg.z_dim))
    z = denormalize(z, cfg.latents_mean, cfg.latents_std)
    return vae.decode(z, return_dict=False)[0][:, :, 0]


def decode(vae: Any, packed: torch.Tensor, grid: tuple[int, int]) -> np.ndarray:
    """Decode packed final latents with an ``AutoencoderKLQwenImage`` (steps 1-4): ``(B, 16h, 16w, 3)`` uint8."""
    return to_uint8(decode_to_images(vae, packed, grid))


def _preview_matrix(channels: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    m = torch.randn(channels, 3, generator=g, dtype=torch.float64)
    return m / m.norm(dim=0, keepdim=True)


def preview_rgb(packed: torch.Tensor, grid: tuple[int, int], channels: int = 16) -> np.ndarray:
    """The fixed latent → RGB preview (module docstring): ``(B, 2h, 2w, 3)`` uint8, one pixel per latent cell."""
    z = unpack_latents(packed.detach().to("cpu", torch.float64), grid, channels)[:, :, 0]  # (B, C, 2h, 2w)
    rgb = torch.einsum("bchw,cr->brhw", z, _preview_matrix(channels))
    return to_uint8(torch.tanh(rgb / 2))


def contact_sheet(images: Sequence[np.ndarray], cols: int = 4, pad: int = 2, min_cell: int = 64) -> np.ndarray:
    """Tile ``(H, W, 3)`` uint8 images left to right, top to bottom, on a white background; images smaller
    than ``min_cell`` are enlarged by an integer factor (nearest neighbour) so tiny previews stay visible."""
    if not images:
        raise ValueError("contact_sheet needs at least one image")
    h, w = images[0].shape[:2]
    if any(im.shape != images[0].shape for im in images):
        raise ValueError("contact_sheet images must share one shape")
    k = max(1, -(-min_cell // max(h, w)))
    h, w = h * k, w * k
    cols = max(1, min(cols, len(images)))
    rows = -(-len(images) // cols)
    sheet = np.full((rows * (h + pad) + pad, cols * (w + pad) + pad, 3), 255, dtype=np.uint8)
    for i, im in enumerate(images):
        r, c = divmod(i, cols)
        big = im.repeat(k, axis=0).repeat(k, axis=1)
        sheet[pad + r * (h + pad): pad + r * (h + pad) + h, pad + c * (w + pad): pad + c * (w + pad) + w] = big
    return sheet


def save_png(image: np.ndarray, path: str | Path) -> Path:
    """Write an ``(H, W, 3)`` uint8 array as PNG."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path)
    return path


def load_vae(folder: str | Path, device: str | torch.device = "cpu", torch_dtype: torch.dtype = torch.float32) -> Any | None:
    """The ``AutoencoderKLQwenImage`` of a pipeline folder (``vae/``), or None when the folder has none."""
    vae_dir = Path(folder) / "vae"
    if not (vae_dir / "config.json").is_file():
        return None
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage.from_pretrained(str(vae_dir), torch_dtype=torch_dtype).to(device).eval()


def decode_rollout(rollout_dir: str | Path, out_dir: str | Path, pipeline_folder: str | Path | None,
                   device: str | torch.device = "cpu") -> dict[str, Any]:
    """Decode a rollout artifact's final latents into ``out_dir/sample_<id>.png`` plus ``contact_sheet.png``.

    With a pipeline folder holding ``vae/`` the VAE decodes (in FP32); otherwise the fixed preview is
    drawn. Returns what was written, the mode (``vae`` / ``preview``) and the decode wall time; raises
    ValueError when the rollout kept no tensors (``rollout.save_tensors=false``).
    """
    from ..trajectories.artifact import read

    traj = read(rollout_dir)
    if "x" not in traj.tensors:
        raise ValueError(f"{rollout_dir} holds no latents (rollout.save_tensors=false): nothing to decode")
    grid = tuple(int(g) for g in traj.manifest["grid"])
    final = traj.tensors["x"][-1]  # (N, T, 64)
    vae = load_vae(pipeline_folder, device) if pipeline_folder else None
    t0 = time.perf_counter()
    images = decode(vae, final, grid) if vae is not None else preview_rgb(final, grid)  # type: ignore[arg-type]
    seconds = time.perf_counter() - t0
    out = Path(out_dir)
    files = [str(save_png(im, out / f"sample_{sid}.png")) for sid, im in zip(traj.sample_ids, images)]
    sheet = save_png(contact_sheet(list(images)), out / "contact_sheet.png")
    info = {"mode": "vae" if vae is not None else "preview", "files": files, "contact_sheet": str(sheet),
            "decode_seconds": seconds, "grid": list(grid), "image_shape": list(images.shape[1:])}
    (out / "decode.json").write_text(json.dumps(info, indent=2))
    return info

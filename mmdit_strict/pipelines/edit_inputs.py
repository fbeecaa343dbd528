"""Input pictures of an edit run → packed conditioning latents (``prompts.edit.source=folder``).

Each picture is VAE-encoded alone (the posterior's mode, as ``QwenImageEditPipeline`` retrieves it),
normalized per channel as the edit pipeline does it — ``(z - mean) / std``, a division, where the
img2img path of ``vae_encode`` multiplies by ``1 / std`` (the two can differ in the last bit) — and packed
2x2. ``mmdit-strict run`` writes them to ``OUTPUT_DIR/conditioning.safetensors`` before the rollout and
points ``prompts.edit`` at that file (``source=latents``), so the run and its stage keys see the latents'
bytes, not the pictures'. The pictures keep their size (sides multiples of 16); unlike the diffusers
pipeline nothing is resized to a 1024² area.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from ..model.edit import ConditionImage
from ..sampling.latents import pack_latents
from .vae_encode import PIXELS_PER_TOKEN, to_vae_input

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
CONDITIONING_FILE = "conditioning.safetensors"


def load_pictures(folder: str | Path) -> list[tuple[str, np.ndarray]]:
    """``(name, (H, W, 3) uint8)`` of every picture in ``folder``, sorted by name; clear errors for a missing
    folder, one without pictures, or a picture whose sides are not multiples of 16."""
    from PIL import Image

    p = Path(folder)
    if not p.is_dir():
        raise ValueError(f"prompts.edit.folder={folder} is not a folder")
    files = sorted(f for f in p.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ValueError(f"prompts.edit.folder={folder} holds no input image ({', '.join(IMAGE_SUFFIXES)})")
    out = []
    for f in files:
        arr = np.asarray(Image.open(f).convert("RGB"))
        h, w = arr.shape[:2]
        if h % PIXELS_PER_TOKEN or w % PIXELS_PER_TOKEN:
            raise ValueError(f"input image {f.name} is {w}×{h} pixels: both sides must be multiples of {PIXELS_PER_TOKEN}")
        out.append((f.name, arr))
    return out


@torch.no_grad()
def encode_picture(vae: Any, picture: np.ndarray) -> ConditionImage:
    """One ``(H, W, 3)`` uint8 picture → its packed latents on the ``(H/16, W/16)`` grid (FP32, CPU)."""
    cfg = vae.config
    x = to_vae_input(picture[None], vae.dtype, vae.device)  # (1, 3, 1, H, W) in [-1, 1]
    z = vae.encode(x).latent_dist.mode()  # (1, 16, 1, H/8, W/8)
    mean = torch.tensor(cfg.latents_mean, dtype=z.dtype, device=z.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std, dtype=z.dtype, device=z.device).view(1, -1, 1, 1, 1)
    z = (z - mean) / std  # the edit pipeline's normalization
    packed = pack_latents(z[:, :, 0])[0]
    h, w = picture.shape[0] // PIXELS_PER_TOKEN, picture.shape[1] // PIXELS_PER_TOKEN
    return ConditionImage(packed.to("cpu", torch.float32), (h, w))


def load_vae(spec: str | None, checkpoint: str | None) -> Any:
    """The VAE of ``prompts.edit.vae``: ``tiny`` (the tiny random pipeline's, seed 0), a pipeline folder, or
    (None) ``model.checkpoint``'s pipeline folder."""
    from diffusers import AutoencoderKLQwenImage

    from .chain import pipeline_folder
    from .tiny import tiny_vae

    if spec == "tiny":
        return tiny_vae(1)  # build_tiny_pipeline(seed=0) draws its VAE from seed 1
    folder = pipeline_folder(spec if spec else checkpoint)
    if folder is None or not (folder / "vae").is_dir():
        raise ValueError("prompts.edit.source=folder needs a VAE: prompts.edit.vae=tiny, prompts.edit.vae=<pipeline folder> "
                         "or model.checkpoint=<pipeline folder> with a vae/ subfolder")
    return AutoencoderKLQwenImage.from_pretrained(str(folder), subfolder="vae", torch_dtype=torch.float32).eval()


def prepare_conditioning(cfg: DictConfig, out_dir: Path) -> DictConfig:
    """``prompts.edit.source=folder``: encode the pictures into ``out_dir/conditioning.safetensors`` and return
    the config pointing ``prompts.edit`` at it (``source=latents``). Any other source: ``cfg`` unchanged."""
    from ..trajectories.conditioning import write_latents_file

    edit = OmegaConf.select(cfg, "prompts.edit")
    if edit is None or edit.source != "folder":
        return cfg
    if not edit.folder:
        raise ValueError("prompts.edit.source=folder needs prompts.edit.folder=DIR (the input pictures)")
    pictures = load_pictures(edit.folder)
    vae = load_vae(edit.vae, cfg.model.checkpoint)
    images = [encode_picture(vae, arr) for _, arr in pictures]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = write_latents_file(out_dir / CONDITIONING_FILE, images,
                              metadata={"pictures": ",".join(name for name, _ in pictures), "folder": str(edit.folder)})
    cfg = OmegaConf.create(OmegaConf.to_container(cfg))  # a writable copy; the caller's stays read-only
    cfg.prompts.edit.source = "latents"
    cfg.prompts.edit.latents = str(path)
    OmegaConf.set_readonly(cfg, True)
    return cfg

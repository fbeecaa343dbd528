"""Input pictures of an edit run → packed conditioning latents (``prompts.edit.source=folder``).

The folder holds one picture per prompt, or one subfolder per prompt holding that prompt's pictures
(``edit_images`` states both layouts; several pictures per prompt is the Qwen-Image-Edit-Plus layout, the
latents of a prompt's pictures following one another, each on its own grid). Each picture is VAE-encoded alone (the posterior's mode, as ``QwenImageEditPipeline`` retrieves it),
normalized per channel as the edit pipeline does it — ``(z - mean) / std``, a division, where the
img2img path of ``vae_encode`` multiplies by ``1 / std`` (the two can differ in the last bit) — and packed
2x2. ``mmdit-strict run`` writes them to ``OUTPUT_DIR/conditioning.safetensors`` before the rollout and
points ``prompts.edit`` at that file (``source=latents``), so the run and its stage keys see the latents'
bytes, not the pictures'. By default the pictures keep their size (sides multiples of 16);
``prompts.edit.vae_area=A`` first resizes each (Lanczos) to about ``A`` pixels at its aspect ratio, sides
multiples of 32, as the diffusers edit pipelines do before their VAE (``A = 1048576``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from ..model.edit import ConditionImage, Conditioning, SampleConditioning
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


def load_picture_sets(folder: str | Path, vae_area: int | None = None) -> list[list[tuple[str, np.ndarray]]]:
    """Per prompt, ``(name, (H, W, 3) uint8)`` of its pictures (``edit_images`` layouts), each resized to about
    ``vae_area`` pixels first when given; clear errors for a bad folder or a side not a multiple of 16."""
    from PIL import Image

    from .edit_images import image_set_files, set_names
    from .encode_edit import condition_image

    if not Path(folder).is_dir():
        raise ValueError(f"prompts.edit.folder={folder} is not a folder")
    if vae_area is not None and vae_area < PIXELS_PER_TOKEN * PIXELS_PER_TOKEN:
        raise ValueError(f"prompts.edit.vae_area={vae_area} must be at least {PIXELS_PER_TOKEN ** 2} pixels (or null)")
    try:
        sets = image_set_files(folder)
    except ValueError as exc:
        raise ValueError(f"prompts.edit.folder: {exc}") from None
    out = []
    for names, files in zip(set_names(folder, sets), sets):
        pictures = []
        for name, f in zip(names, files):
            with Image.open(f) as im:
                arr = np.asarray(condition_image(im, vae_area))
            h, w = arr.shape[:2]
            if h % PIXELS_PER_TOKEN or w % PIXELS_PER_TOKEN:
                raise ValueError(f"input image {name} is {w}×{h} pixels: both sides must be multiples of {PIXELS_PER_TOKEN} "
                                 "(or set prompts.edit.vae_area to resize it)")
            pictures.append((name, arr))
        out.append(pictures)
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
    area = OmegaConf.select(edit, "vae_area")
    sets = load_picture_sets(edit.folder, None if area is None else int(area))
    vae = load_vae(edit.vae, cfg.model.checkpoint)
    images: list[SampleConditioning] = []
    for pictures in sets:
        encoded = [encode_picture(vae, arr) for _, arr in pictures]
        images.append(encoded[0] if len(encoded) == 1 else Conditioning(encoded))
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [[name for name, _ in pictures] for pictures in sets]
    meta = {"pictures": ",".join("+".join(n) for n in names), "folder": str(edit.folder)}  # a prompt's pictures joined by +
    if area is not None:
        meta["vae_area"] = str(area)
    path = write_latents_file(out_dir / CONDITIONING_FILE, images, metadata=meta)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg))  # a writable copy; the caller's stays read-only
    cfg.prompts.edit.source = "latents"
    cfg.prompts.edit.latents = str(path)
    OmegaConf.set_readonly(cfg, True)
    return cfg

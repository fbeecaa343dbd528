"""Image-conditioned prompt encoding for Qwen-Image-Edit (Qwen2.5-VL with its vision tower).

What one (prompt, input image) pair becomes — the steps of diffusers' ``QwenImageEditPipeline``:

1. the image is resized to about :data:`CONDITION_AREA` pixels at its aspect ratio, sides rounded to
   multiples of 32 (:func:`condition_size`, Lanczos), as the edit pipeline does before encoding the prompt
   (``condition_area=None`` keeps the image as it is);
2. the prompt goes into the edit chat template (:data:`EDIT_PROMPT_TEMPLATE`), whose single
   ``<|image_pad|>`` the folder's ``Qwen2VLProcessor`` expands to one token per merged image patch; the
   processor also cuts the image into patches (``pixel_values``, ``image_grid_thw``);
3. the text encoder runs on ids, mask and patches; the last hidden state's valid rows are kept and the first
   :data:`EDIT_DROP_TOKENS` (64) dropped; rows are zero-padded to the longest prompt with a 0/1 mask.

Prompts are encoded one per batch by default, as in ``encode.py``. The negative prompt is encoded
text-only with the text-to-image template (``encode.encode_batch``): rollout shares one negative across
all prompts, while diffusers' edit pipeline encodes the negative with each prompt's image. The file is
``encode.py``'s format; its header also names the template, the images and their sha256.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Sequence

import torch

from .encode import EncodedPrompts, encode_batch, write_prompt_file

EDIT_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, background), "
    "then explain how the user's text instruction should alter or modify the image. Generate a new image that meets the "
    "user's requirements while maintaining consistency with the original input where appropriate.<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
)
EDIT_DROP_TOKENS = 64
CONDITION_AREA = 1024 * 1024
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
_VISION_MARKERS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def condition_size(width: int, height: int, area: int = CONDITION_AREA) -> tuple[int, int]:
    """``(width, height)`` of about ``area`` pixels at ``width / height``, each rounded to a multiple of 32."""
    if width < 1 or height < 1 or area < 1:
        raise ValueError(f"image size and area must be positive, got {width}x{height}, area {area}")
    ratio = width / height
    w = math.sqrt(area * ratio)
    return round(w / 32) * 32, round(w / ratio / 32) * 32


def condition_image(image: Any, area: int | None = CONDITION_AREA) -> Any:
    """The PIL ``image`` as RGB, resized (Lanczos) to :func:`condition_size` unless ``area`` is None."""
    from PIL import Image

    image = image.convert("RGB")
    if area is None:
        return image
    size = condition_size(*image.size, area)
    return image if size == image.size else image.resize(size, resample=Image.LANCZOS)


def load_images(folder: str | Path) -> list[tuple[str, Any]]:
    """``(name, PIL image)`` of every picture in ``folder``, sorted by name (clear errors if none)."""
    from PIL import Image

    p = Path(folder)
    if not p.is_dir():
        raise ValueError(f"images folder {folder} is not a folder")
    files = sorted(f for f in p.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ValueError(f"images folder {folder} holds no image ({', '.join(IMAGE_SUFFIXES)})")
    out = []
    for f in files:
        with Image.open(f) as im:
            out.append((f.name, im.convert("RGB")))
    return out


def encode_edit_batch(processor: Any, text_encoder: Any, prompts: Sequence[str], images: Sequence[Any], *,
                      device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Encode one batch of prompts, each with its (already resized) image: ``(N, L, C)`` and ``(N, L)`` mask."""
    if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be a non-empty list of strings")
    if len(images) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts and {len(images)} images: give one image per prompt")
    for p in prompts:
        if any(m in p for m in _VISION_MARKERS):
            raise ValueError(f"prompt {p!r} holds a vision token; the template places the image itself")
    text = [EDIT_PROMPT_TEMPLATE.format(p) for p in prompts]
    inputs = processor(text=text, images=list(images), padding=True, return_tensors="pt").to(device)
    with torch.no_grad():
        out = text_encoder(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                           pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                           output_hidden_states=True)
    valid = inputs["attention_mask"].bool()
    lengths = valid.sum(dim=1).tolist()
    if min(lengths) <= EDIT_DROP_TOKENS:
        raise ValueError(f"a templated edit prompt has {min(lengths)} tokens, not more than the {EDIT_DROP_TOKENS} "
                         "the template drops: this tokenizer does not fit Qwen-Image-Edit's template")
    rows = [r[EDIT_DROP_TOKENS:] for r in torch.split(out.hidden_states[-1][valid], lengths, dim=0)]
    longest = max(r.shape[0] for r in rows)
    embeds = torch.stack([torch.cat([r, r.new_zeros(longest - r.shape[0], r.shape[1])]) for r in rows])
    mask = torch.zeros(len(rows), longest, dtype=torch.long, device=embeds.device)
    for i, r in enumerate(rows):
        mask[i, : r.shape[0]] = 1
    return embeds.to(dtype=text_encoder.dtype), mask


def encode_edit_prompts(processor: Any, text_encoder: Any, prompts: Sequence[str], images: Sequence[Any],
                        negative_prompt: str | None = " ", *, batch_size: int = 1, condition_area: int | None = CONDITION_AREA,
                        device: str | torch.device = "cpu") -> EncodedPrompts:
    """Encode ``prompts[i]`` with ``images[i]`` (PIL images, one per prompt) in batches of ``batch_size``;
    the negative prompt text-only (module docstring)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    if len(images) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts and {len(images)} images: give one image per prompt")
    if any(im is None for im in images):
        raise ValueError(f"prompt {[im is None for im in images].index(True)} has no image")
    resized = [condition_image(im, condition_area) for im in images]
    parts = [encode_edit_batch(processor, text_encoder, prompts[i:i + batch_size], resized[i:i + batch_size], device=device)
             for i in range(0, len(prompts), batch_size)]
    longest = max(e.shape[1] for e, _ in parts)
    embeds = torch.cat([torch.nn.functional.pad(e, (0, 0, 0, longest - e.shape[1])) for e, _ in parts])
    mask = torch.cat([torch.nn.functional.pad(m, (0, longest - m.shape[1])) for _, m in parts])
    neg = None
    if negative_prompt is not None:
        ne, nm = encode_batch(processor.tokenizer, text_encoder, [negative_prompt], device=device)
        neg = ne[0, : int(nm[0].sum())]
    return EncodedPrompts(embeds, mask, neg, list(prompts), negative_prompt)


def image_sha256(image: Any) -> str:
    """sha256 of an image's RGB pixels and size (what the encoder sees before resizing)."""
    rgb = image.convert("RGB")
    return hashlib.sha256(f"{rgb.size[0]}x{rgb.size[1]}\x00".encode() + rgb.tobytes()).hexdigest()


def write_edit_prompt_file(path: str | Path, enc: EncodedPrompts, *, pipeline_folder: str | Path, batch_size: int,
                           image_names: Sequence[str], images: Sequence[Any], condition_area: int | None) -> Path:
    """``encode.write_prompt_file`` with the edit template and a header naming the images per prompt."""
    from .encode import folder_identity

    extra = {
        "images": json.dumps(list(image_names), ensure_ascii=False),
        "images_sha256": json.dumps([image_sha256(im) for im in images]),
        "condition_area": str(condition_area) if condition_area is not None else "none",
        "negative_conditioning": "text-only (text-to-image template; one negative shared by all prompts)",
        "processor_sha256": folder_identity(Path(pipeline_folder) / "processor", ["*.json", "*.txt", "*.jinja"]),
    }
    return write_prompt_file(path, enc, pipeline_folder=pipeline_folder, batch_size=batch_size,
                             template=EDIT_PROMPT_TEMPLATE, drop_tokens=EDIT_DROP_TOKENS, extra_metadata=extra)


def load_edit_components(folder: str | Path, *, torch_dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """The ``Qwen2VLProcessor`` (``processor/``) and the Qwen2.5-VL text encoder of a Qwen-Image-Edit folder."""
    from .encode import load_text_components
    from .tiny_edit import load_processor

    processor = load_processor(folder)
    _, encoder = load_text_components(folder, torch_dtype=torch_dtype, device=device)
    return processor, encoder

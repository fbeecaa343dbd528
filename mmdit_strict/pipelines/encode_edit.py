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

Prompts are encoded one per batch by default, as in ``encode.py``. The negative prompt is encoded like a
prompt, with each prompt's own image (what diffusers' edit pipelines do), so every prompt has its own
negative (``negative_with_images=True``, the default); ``negative_with_images=False`` encodes it once,
text-only, with the text-to-image template (``encode.encode_batch``) and all prompts share it. The file is
``encode.py``'s format; its header also names the template, the images and their sha256, and how the
negative was encoded.

:func:`encode_vision_batch` (templated texts with their images → embeddings) is shared with the
several-images-per-prompt contract of ``encode_edit_plus``.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence

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


def check_prompts(prompts: Sequence[str]) -> None:
    """A clear error unless ``prompts`` is a non-empty list of strings without vision tokens (the template
    places the images itself)."""
    if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be a non-empty list of strings")
    for p in prompts:
        if any(m in p for m in _VISION_MARKERS):
            raise ValueError(f"prompt {p!r} holds a vision token; the template places the image itself")


def encode_vision_batch(processor: Any, text_encoder: Any, texts: Sequence[str], images: Sequence[Any], *,
                        device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Encode templated ``texts`` whose ``<|image_pad|>`` tokens take ``images`` in order (all the texts'
    images in one flat list): ``(N, L, C)`` embeddings (the first :data:`EDIT_DROP_TOKENS` rows of each
    dropped, zero-padded to the longest) and their ``(N, L)`` 0/1 mask."""
    inputs = processor(text=list(texts), images=list(images), padding=True, return_tensors="pt").to(device)
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


def in_batches(encode: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], n: int,
               batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``encode(start, stop)`` over ``[0, n)`` in batches of ``batch_size``, zero-padded to the longest."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    parts = [encode(i, min(n, i + batch_size)) for i in range(0, n, batch_size)]
    longest = max(e.shape[1] for e, _ in parts)
    embeds = torch.cat([torch.nn.functional.pad(e, (0, 0, 0, longest - e.shape[1])) for e, _ in parts])
    mask = torch.cat([torch.nn.functional.pad(m, (0, longest - m.shape[1])) for _, m in parts])
    return embeds, mask


def encode_edit_batch(processor: Any, text_encoder: Any, prompts: Sequence[str], images: Sequence[Any], *,
                      device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Encode one batch of prompts, each with its (already resized) image: ``(N, L, C)`` and ``(N, L)`` mask."""
    check_prompts(prompts)
    if len(images) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts and {len(images)} images: give one image per prompt")
    return encode_vision_batch(processor, text_encoder, [EDIT_PROMPT_TEMPLATE.format(p) for p in prompts], images,
                               device=device)


def text_only_negative(processor: Any, text_encoder: Any, negative_prompt: str, *,
                       device: str | torch.device = "cpu") -> torch.Tensor:
    """The negative prompt's valid rows ``(L, C)``, text-only with the text-to-image template."""
    ne, nm = encode_batch(processor.tokenizer, text_encoder, [negative_prompt], device=device)
    return ne[0, : int(nm[0].sum())]


def encode_edit_prompts(processor: Any, text_encoder: Any, prompts: Sequence[str], images: Sequence[Any],
                        negative_prompt: str | None = " ", *, batch_size: int = 1, condition_area: int | None = CONDITION_AREA,
                        negative_with_images: bool = True, device: str | torch.device = "cpu") -> EncodedPrompts:
    """Encode ``prompts[i]`` with ``images[i]`` (PIL images, one per prompt) in batches of ``batch_size``;
    the negative prompt with each prompt's image (one negative per prompt), or text-only and shared
    (``negative_with_images=False``; module docstring)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    if len(images) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts and {len(images)} images: give one image per prompt")
    if any(im is None for im in images):
        raise ValueError(f"prompt {[im is None for im in images].index(True)} has no image")
    resized = [condition_image(im, condition_area) for im in images]
    return encode_with_negatives(encode_edit_batch, processor, text_encoder, prompts, resized, negative_prompt,
                                 negative_with_images, batch_size, device)


def encode_with_negatives(encode_batch: Any, processor: Any, text_encoder: Any, prompts: Sequence[str],
                          images: Sequence[Any], negative_prompt: str | None, negative_with_images: bool,
                          batch_size: int, device: str | torch.device) -> EncodedPrompts:
    """``prompts[i]`` with its (already resized) ``images[i]`` through ``encode_batch(processor, encoder, texts,
    images, device=)`` in batches, and the negative: none, text-only and shared, or with each prompt's images."""
    embeds, mask = in_batches(lambda a, b: encode_batch(processor, text_encoder, prompts[a:b], images[a:b], device=device),
                              len(prompts), batch_size)
    if negative_prompt is None:
        return EncodedPrompts(embeds, mask, None, list(prompts), None)
    if not negative_with_images:
        return EncodedPrompts(embeds, mask, text_only_negative(processor, text_encoder, negative_prompt, device=device),
                              list(prompts), negative_prompt)
    negatives = [negative_prompt] * len(prompts)
    ne, nm = in_batches(lambda a, b: encode_batch(processor, text_encoder, negatives[a:b], images[a:b], device=device),
                        len(prompts), batch_size)
    return EncodedPrompts(embeds, mask, ne, list(prompts), negative_prompt, nm)


def image_sha256(image: Any) -> str:
    """sha256 of an image's RGB pixels and size (what the encoder sees before resizing)."""
    rgb = image.convert("RGB")
    return hashlib.sha256(f"{rgb.size[0]}x{rgb.size[1]}\x00".encode() + rgb.tobytes()).hexdigest()


def write_edit_prompt_file(path: str | Path, enc: EncodedPrompts, *, pipeline_folder: str | Path, batch_size: int,
                           image_names: Sequence[Any], images: Sequence[Any], condition_area: int | None,
                           template: str = EDIT_PROMPT_TEMPLATE) -> Path:
    """``encode.write_prompt_file`` with the edit ``template`` and a header naming the images per prompt
    (one name per prompt, or a list of names per prompt with several images) and their sha256."""
    from .encode import folder_identity

    def sha(im: Any) -> Any:
        return [image_sha256(i) for i in im] if isinstance(im, (list, tuple)) else image_sha256(im)

    negative = ("with each prompt's own images (one negative per prompt, as the diffusers edit pipelines encode it)"
                if enc.negative_mask is not None else "text-only (text-to-image template; one negative shared by all prompts)")
    extra = {
        "images": json.dumps([list(n) if isinstance(n, (list, tuple)) else n for n in image_names], ensure_ascii=False),
        "images_sha256": json.dumps([sha(im) for im in images]),
        "condition_area": str(condition_area) if condition_area is not None else "none",
        "negative_conditioning": negative,
        "processor_sha256": folder_identity(Path(pipeline_folder) / "processor", ["*.json", "*.txt", "*.jinja"]),
    }
    return write_prompt_file(path, enc, pipeline_folder=pipeline_folder, batch_size=batch_size,
                             template=template, drop_tokens=EDIT_DROP_TOKENS, extra_metadata=extra)


def load_edit_components(folder: str | Path, *, torch_dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """The ``Qwen2VLProcessor`` (``processor/``) and the Qwen2.5-VL text encoder of a Qwen-Image-Edit folder."""
    from .encode import load_text_components
    from .tiny_edit import load_processor

    processor = load_processor(folder)
    _, encoder = load_text_components(folder, torch_dtype=torch_dtype, device=device)
    return processor, encoder

"""Image-conditioned prompt encoding for Qwen-Image-Edit-Plus: several input images per prompt.

The contract of diffusers' ``QwenImageEditPlusPipeline``, step by step, for one prompt with images
``1..n``:

1. every image is resized to about :data:`PLUS_CONDITION_AREA` pixels (384²) at its aspect ratio, sides
   rounded to multiples of 32 (Lanczos; ``encode_edit.condition_image``); the vision tower sees these;
2. the user turn is one block ``Picture k: <|vision_start|><|image_pad|><|vision_end|>`` per image
   (:data:`PICTURE_BLOCK`, ``k`` counting from 1), directly followed by the prompt text, in the edit
   chat template without its single image slot (:data:`PLUS_PROMPT_TEMPLATE`);
3. the processor expands each image pad to that image's merged patches; the text encoder's last hidden
   state is kept from row :data:`~mmdit_strict.pipelines.encode_edit.EDIT_DROP_TOKENS` (64) on.

The negative prompt goes through the same steps with the same images (one negative per prompt), unless
``negative_with_images=False`` (one text-only negative, shared). The transformer side — each image's VAE
latents after the noisy latents, at about :data:`PLUS_VAE_AREA` pixels — is ``model.edit`` and
``edit_inputs``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .encode import EncodedPrompts
from .encode_edit import (
    EDIT_PROMPT_TEMPLATE, check_prompts, condition_image, encode_vision_batch, encode_with_negatives,
)

PICTURE_BLOCK = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
PLUS_PROMPT_TEMPLATE = EDIT_PROMPT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
PLUS_CONDITION_AREA = 384 * 384
PLUS_VAE_AREA = 1024 * 1024


def plus_text(prompt: str, count: int) -> str:
    """The templated text of ``prompt`` with ``count`` pictures (step 2 of the module docstring)."""
    if count < 1:
        raise ValueError(f"a Plus prompt needs at least one image, got {count}")
    return PLUS_PROMPT_TEMPLATE.format("".join(PICTURE_BLOCK.format(k + 1) for k in range(count)) + prompt)


def check_image_sets(prompts: Sequence[str], image_sets: Sequence[Sequence[Any]]) -> None:
    """A clear error unless there is one non-empty list of images per prompt."""
    if len(image_sets) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts and {len(image_sets)} image lists: give one list of images per prompt")
    for i, s in enumerate(image_sets):
        if isinstance(s, (str, bytes)) or not isinstance(s, Sequence) or len(s) == 0:
            raise ValueError(f"prompt {i} needs a non-empty list of images, got {type(s).__name__}")
        if any(im is None for im in s):
            raise ValueError(f"prompt {i} has a missing image (None) in its list")


def encode_plus_batch(processor: Any, text_encoder: Any, prompts: Sequence[str], image_sets: Sequence[Sequence[Any]], *,
                      device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Encode one batch: ``prompts[i]`` with the (already resized) ``image_sets[i]``; ``(N, L, C)`` and ``(N, L)``."""
    check_prompts(prompts)
    check_image_sets(prompts, image_sets)
    texts = [plus_text(p, len(s)) for p, s in zip(prompts, image_sets)]
    return encode_vision_batch(processor, text_encoder, texts, [im for s in image_sets for im in s], device=device)


def encode_plus_prompts(processor: Any, text_encoder: Any, prompts: Sequence[str], image_sets: Sequence[Sequence[Any]],
                        negative_prompt: str | None = " ", *, batch_size: int = 1,
                        condition_area: int | None = PLUS_CONDITION_AREA, negative_with_images: bool = True,
                        device: str | torch.device = "cpu") -> EncodedPrompts:
    """Encode ``prompts[i]`` with its PIL images ``image_sets[i]`` in batches of ``batch_size``; the negative
    prompt with each prompt's images (one per prompt) or text-only and shared (module docstring)."""
    check_prompts(prompts)
    check_image_sets(prompts, image_sets)
    resized = [[condition_image(im, condition_area) for im in s] for s in image_sets]
    return encode_with_negatives(encode_plus_batch, processor, text_encoder, prompts, resized, negative_prompt,
                                 negative_with_images, batch_size, device)

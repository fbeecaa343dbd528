"""Edit conditioning (Qwen-Image-Edit): the input image's packed latents ride behind the noisy latents.

Diffusers' ``QwenImageEditPipeline`` feeds the transformer ``cat([noisy, image_latents], dim=1)`` with
two grids per sample in ``img_shapes`` — ``[(1, h, w), (1, h', w')]``, the noisy grid then the input
image's — so the conditioning tokens get RoPE frame index 1 and their own centred spatial positions, and
it keeps only the first ``h·w`` rows of the output (the noisy tokens' velocity).

Diffusers needs every sample of a batch to share both grids. Here a batch may mix conditioning sizes:
shorter samples are zero-padded at the end and the forward is told so (``image_padding=True``), which
the strict graph honours by packing each sample's valid rows, so a sample's bytes do not depend on its
neighbours' image sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

ImgShape = tuple[int, int, int]


@dataclass(frozen=True)
class ConditionImage:
    """One input image as the transformer reads it: packed latents ``(h·w, C)`` on a ``(h, w)`` token grid."""

    latents: torch.Tensor
    grid: tuple[int, int]

    def __post_init__(self) -> None:
        h, w = self.grid
        if h < 1 or w < 1:
            raise ValueError(f"a conditioning grid needs positive sides, got {self.grid}")
        if self.latents.dim() != 2 or self.latents.shape[0] != h * w:
            raise ValueError(f"conditioning latents must be ({h * w}, C) for grid {self.grid}, got {tuple(self.latents.shape)}")

    @property
    def tokens(self) -> int:
        """Conditioning tokens (rows) of this image."""
        return self.grid[0] * self.grid[1]


@dataclass(frozen=True)
class EditBatch:
    """Forward inputs of an edit batch: ``hidden_states`` ``(B, T + max T_cond, C)``, their ``img_shapes``,
    whether some sample is padded (``image_padding``), and ``noisy_tokens`` ``T`` (rows to keep)."""

    hidden_states: torch.Tensor
    img_shapes: list[list[ImgShape]]
    image_padding: bool
    noisy_tokens: int

    def velocity(self, out: torch.Tensor) -> torch.Tensor:
        """The model output's noisy-token rows ``(B, T, C)`` (diffusers' ``noise_pred[:, :T]``)."""
        return out[:, : self.noisy_tokens]


def edit_batch(x: torch.Tensor, images: Sequence[ConditionImage], grid: tuple[int, int]) -> EditBatch:
    """Append each sample's conditioning latents after its noisy latents ``x`` ``(B, h·w, C)`` on ``grid``.

    Samples whose conditioning is shorter than the longest are zero-padded at the end (``image_padding``).
    """
    if x.dim() != 3:
        raise ValueError(f"noisy latents must be (B, tokens, C), got {tuple(x.shape)}")
    B, T, C = x.shape
    if T != grid[0] * grid[1]:
        raise ValueError(f"noisy latents hold {T} tokens but the grid {grid} has {grid[0] * grid[1]}")
    if len(images) != B:
        raise ValueError(f"an edit batch needs one conditioning image per sample: {B} samples, {len(images)} images")
    longest = max(im.tokens for im in images)
    hidden = x.new_zeros(B, T + longest, C)
    hidden[:, :T] = x
    for b, im in enumerate(images):
        if im.latents.shape[1] != C:
            raise ValueError(f"conditioning image {b} has {im.latents.shape[1]} channels, the noisy latents {C}")
        hidden[b, T:T + im.tokens] = im.latents.to(device=x.device, dtype=x.dtype)
    shapes = [[(1, grid[0], grid[1]), (1, im.grid[0], im.grid[1])] for im in images]
    padded = any(im.tokens != longest for im in images)
    return EditBatch(hidden, shapes, padded, T)

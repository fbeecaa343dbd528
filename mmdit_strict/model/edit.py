"""Edit conditioning (Qwen-Image-Edit): the input images' packed latents ride behind the noisy latents.

Diffusers' ``QwenImageEditPipeline`` feeds the transformer ``cat([noisy, image_latents], dim=1)`` with
two grids per sample in ``img_shapes`` — ``[(1, h, w), (1, h', w')]``, the noisy grid then the input
image's — so the conditioning tokens get RoPE frame index 1 and their own centred spatial positions, and
it keeps only the first ``h·w`` rows of the output (the noisy tokens' velocity).

Qwen-Image-Edit-Plus (diffusers' ``QwenImageEditPlusPipeline``) takes several input images per prompt:
their latents follow the noisy latents one image after the other, each with its own grid in
``img_shapes`` (``[(1, h, w), (1, h1, w1), (1, h2, w2), ...]``), so image ``k`` gets RoPE frame index
``k + 1``. A :class:`Conditioning` holds one sample's images in that order; a lone
:class:`ConditionImage` is the one-image case.

Diffusers needs every sample of a batch to share all its grids. Here a batch may mix conditioning sizes:
shorter samples are zero-padded at the end and the forward is told so (``image_padding=True``), which
the strict graph honours by packing each sample's valid rows, so a sample's bytes do not depend on its
neighbours' image sizes and counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

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

    @property
    def grids(self) -> tuple[tuple[int, int], ...]:
        """The image's grid, as the one-entry tuple :class:`Conditioning` has one entry per image for."""
        return (self.grid,)

    @property
    def images(self) -> tuple["ConditionImage", ...]:
        """This image alone (the interface :class:`Conditioning` shares)."""
        return (self,)


@dataclass(frozen=True, init=False)
class Conditioning:
    """One sample's input images in order (Qwen-Image-Edit-Plus): ``latents`` are their packed latents
    one after the other ``(Σ h_k·w_k, C)``, ``grids`` their token grids, ``tokens`` the row count."""

    images: tuple[ConditionImage, ...]
    latents: torch.Tensor

    def __init__(self, images: Sequence[ConditionImage]) -> None:
        images = tuple(images)
        if not images or not all(isinstance(im, ConditionImage) for im in images):
            raise ValueError("a Conditioning needs at least one ConditionImage")
        channels = {im.latents.shape[1] for im in images}
        if len(channels) != 1:
            raise ValueError(f"the input images of one sample have different channel counts: {sorted(channels)}")
        object.__setattr__(self, "images", images)
        object.__setattr__(self, "latents", torch.cat([im.latents for im in images]) if len(images) > 1 else images[0].latents)

    @property
    def grids(self) -> tuple[tuple[int, int], ...]:
        """Each image's ``(h, w)`` token grid, in order."""
        return tuple(im.grid for im in self.images)

    @property
    def tokens(self) -> int:
        """Conditioning tokens (rows) of all the images together."""
        return sum(im.tokens for im in self.images)


#: what one sample's edit conditioning may be: one image, or several in order
SampleConditioning = Union[ConditionImage, Conditioning]


def split_conditioning(latents: torch.Tensor, grids: Sequence[Sequence[int]]) -> SampleConditioning:
    """Rebuild one sample's conditioning from its concatenated latents and its grids (one ``(h, w)`` per
    image): a :class:`ConditionImage` for one grid, a :class:`Conditioning` for several."""
    sizes = [int(g[0]) * int(g[1]) for g in grids]
    if not sizes:
        raise ValueError("a sample's conditioning needs at least one grid")
    if latents.dim() != 2 or latents.shape[0] != sum(sizes):
        raise ValueError(f"conditioning latents of grids {[list(g) for g in grids]} must be ({sum(sizes)}, C), "
                         f"got {tuple(latents.shape)}")
    parts = [ConditionImage(chunk, (int(g[0]), int(g[1]))) for chunk, g in zip(torch.split(latents, sizes), grids)]
    return parts[0] if len(parts) == 1 else Conditioning(parts)


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


def edit_batch(x: torch.Tensor, images: Sequence[SampleConditioning], grid: tuple[int, int]) -> EditBatch:
    """Append each sample's conditioning latents after its noisy latents ``x`` ``(B, h·w, C)`` on ``grid``.

    ``images[b]`` is sample ``b``'s input image or, for several, its :class:`Conditioning` (the images in
    order; each adds its grid to ``img_shapes``). Samples whose conditioning is shorter than the longest
    are zero-padded at the end (``image_padding``).
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
    shapes = [[(1, grid[0], grid[1])] + [(1, h, w) for h, w in im.grids] for im in images]
    padded = any(im.tokens != longest for im in images)
    return EditBatch(hidden, shapes, padded, T)

"""Edit conditioning of a run: one or several input images per sample, as packed latents (``prompts.edit``).

Sources (``prompts.edit.source``):

* ``seeded``: latents drawn from ``torch.Generator(cpu)``. Sample ``i`` gets
  ``images_per_prompt[i % len]`` images (an int is the same count for all); its image ``j`` lies on the
  grid of ``prompts.edit.sizes[(i + j) % len(sizes)]`` (pixels, sides multiples of 16) and is keyed by
  (``prompts.edit.seed``, ``i``, ``j``): no VAE needed. Image 0 of every sample is the draw a one-image
  run makes, so ``images_per_prompt=1`` is the one-image layout, byte for byte;
* ``latents``: a safetensors file (``latents.{k}`` ``(tokens, C)``, ``grid.{k}`` ``(2,)`` for one image
  or ``(n, 2)`` for ``n`` images whose latents follow one another; what ``pipelines.edit_inputs`` writes
  from a folder of pictures); sample ``i`` takes entry ``i % K``;
* ``folder``: pictures VAE-encoded into such a file before the run starts (``mmdit-strict run`` does it;
  a bare rollout refuses the source and names the file form).

The rollout records each sample's latents (``condition.{i}``, all its images in order), their grids and
sha256 — per image too when a sample has several — in its artifact; the recompute and the localizer
replay those recorded bytes, never the source.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from ..config.arch import ArchConfig
from ..model.edit import ConditionImage, Conditioning, SampleConditioning, split_conditioning
from .hashing import tensor_sha256

SOURCES = ("seeded", "latents", "folder")
PIXELS_PER_TOKEN = 16  # 8x VAE, then 2x2 packing


def pixel_grid(size: Sequence[int], what: str) -> tuple[int, int]:
    """``(height, width)`` pixels → ``(h, w)`` tokens; a clear error unless both are positive multiples of 16."""
    if not isinstance(size, Sequence) or len(size) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in size):
        raise ValueError(f"{what} must be [height, width] in pixels, got {size!r}")
    h, w = int(size[0]), int(size[1])
    if h < PIXELS_PER_TOKEN or w < PIXELS_PER_TOKEN or h % PIXELS_PER_TOKEN or w % PIXELS_PER_TOKEN:
        raise ValueError(f"{what}={h}×{w}: an input image's sides must be positive multiples of {PIXELS_PER_TOKEN} pixels")
    return h // PIXELS_PER_TOKEN, w // PIXELS_PER_TOKEN


def image_counts(value: Any) -> list[int]:
    """``prompts.edit.images_per_prompt`` as a non-empty list of counts >= 1 (an int is a one-entry list)."""
    counts = [value] if isinstance(value, int) and not isinstance(value, bool) else list(value) if isinstance(value, Sequence) else None
    if not counts or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in counts):
        raise ValueError(f"prompts.edit.images_per_prompt must be a count >= 1 or a non-empty list of them, got {value!r}")
    return counts


def _seeded_image(grid: tuple[int, int], seed: int, i: int, j: int, channels: int) -> ConditionImage:
    key = 2_000_003 * (int(seed) + 1) + i + 1_000_000_007 * j  # j = 0: the one-image draw of sample i
    g = torch.Generator().manual_seed(key)
    return ConditionImage(torch.randn(grid[0] * grid[1], channels, generator=g), grid)


def seeded_images(sizes: Sequence[Sequence[int]], seed: int, n: int, channels: int,
                  images_per_prompt: Any = 1) -> list[SampleConditioning]:
    """``n`` samples' conditioning drawn per sample (module docstring: counts, sizes and keys)."""
    if not sizes:
        raise ValueError("prompts.edit.sizes needs at least one [height, width]")
    grids = [pixel_grid(list(s), f"prompts.edit.sizes[{k}]") for k, s in enumerate(sizes)]
    counts = image_counts(images_per_prompt)
    out: list[SampleConditioning] = []
    for i in range(n):
        ims = [_seeded_image(grids[(i + j) % len(grids)], seed, i, j, channels) for j in range(counts[i % len(counts)])]
        out.append(ims[0] if len(ims) == 1 else Conditioning(ims))
    return out


def write_latents_file(path: str | Path, images: Sequence[SampleConditioning], metadata: dict[str, str] | None = None) -> Path:
    """Save conditioning latents as ``latents.{k}`` (FP32) and ``grid.{k}`` (int64: ``(2,)`` for one image,
    ``(n, 2)`` for a sample of ``n`` images) for ``source=latents``."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for k, im in enumerate(images):
        tensors[f"latents.{k}"] = im.latents.detach().to("cpu", torch.float32).contiguous()
        grids = [list(g) for g in im.grids]
        tensors[f"grid.{k}"] = torch.tensor(grids[0] if isinstance(im, ConditionImage) else grids, dtype=torch.int64)
    path = Path(path)
    save_file(tensors, str(path), metadata=metadata)
    return path


def read_latents_file(path: str | Path, channels: int) -> list[SampleConditioning]:
    """The images of a :func:`write_latents_file` file, with a clear error for a missing or malformed one."""
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"prompts.edit.latents={path} is not a file")
    data = load_file(str(p))
    k, out = 0, []
    while f"latents.{k}" in data:
        if f"grid.{k}" not in data:
            raise ValueError(f"{path}: latents.{k} has no grid.{k}")
        grid = data[f"grid.{k}"]
        lat = data[f"latents.{k}"]
        grids = [grid.tolist()] if grid.dim() == 1 else grid.tolist()
        tokens = sum(int(g[0]) * int(g[1]) for g in grids) if all(len(g) == 2 for g in grids) else -1
        if grid.dim() not in (1, 2) or grid.shape[-1] != 2 or not grids or lat.dim() != 2 or lat.shape[1] != channels \
                or lat.shape[0] != tokens:
            raise ValueError(f"{path}: latents.{k} must be (Σ h·w, {channels}) with grid.{k} = [h, w] (one image) or "
                             f"[[h, w], ...] (several), got {tuple(lat.shape)} and {grid.tolist()}")
        if not torch.isfinite(lat).all():
            raise ValueError(f"{path}: latents.{k} contains NaN or Inf")
        out.append(split_conditioning(lat.to(torch.float32), grids))
        k += 1
    if not out:
        raise ValueError(f"{path} holds no conditioning latents (expected latents.0, grid.0, ...)")
    return out


def make_images(edit: Any, n: int, arch: ArchConfig) -> list[SampleConditioning] | None:
    """The ``n`` samples' conditioning images of ``prompts.edit`` (None for text-to-image), FP32 on the CPU."""
    source = edit.source
    if source is None:
        return None
    if source not in SOURCES:
        raise ValueError(f"prompts.edit.source must be one of {list(SOURCES)} or null, got {source!r}")
    if source == "seeded":
        return seeded_images(list(edit.sizes), int(edit.seed), n, arch.in_channels, _plain(getattr(edit, "images_per_prompt", 1)))
    if source == "folder":
        raise ValueError("prompts.edit.source=folder is encoded by `mmdit-strict run` before the rollout; here pass the "
                         "encoded file as prompts.edit.source=latents prompts.edit.latents=FILE")
    if not edit.latents:
        raise ValueError("prompts.edit.source=latents needs prompts.edit.latents=FILE (safetensors of latents.{k}, grid.{k})")
    table = read_latents_file(edit.latents, arch.in_channels)
    return [table[i % len(table)] for i in range(n)]


def _plain(value: Any) -> Any:
    """An OmegaConf list as a plain list (other values unchanged)."""
    from omegaconf import ListConfig, OmegaConf

    return OmegaConf.to_container(value) if isinstance(value, ListConfig) else value


def _sha(latents: torch.Tensor) -> str:
    return tensor_sha256(latents.detach().to("cpu", torch.float32))


def image_hashes(images: Sequence[SampleConditioning]) -> list[dict[str, Any]]:
    """Per sample: the conditioning grid and the sha256 of its FP32 latents. A sample of several images has
    ``grid`` ``[[h, w], ...]`` (one per image), the sha256 of all its latents in order, and ``images``
    (each image's grid and sha256); a one-image sample keeps the one-image form ``[h, w]``."""
    out = []
    for im in images:
        if isinstance(im, ConditionImage):
            out.append({"grid": list(im.grid), "sha256": _sha(im.latents)})
        else:
            out.append({"grid": [list(g) for g in im.grids], "sha256": _sha(im.latents),
                        "images": [{"grid": list(c.grid), "sha256": _sha(c.latents)} for c in im.images]})
    return out


def recorded_grids(grid: Sequence[Any]) -> list[list[int]]:
    """A recorded sample grid as a list of ``[h, w]``: ``[h, w]`` (one image) or ``[[h, w], ...]``."""
    return [list(grid)] if grid and all(isinstance(v, int) for v in grid) else [list(g) for g in grid]

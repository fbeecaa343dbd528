"""Edit conditioning of a run: one input image per sample, as packed latents (``prompts.edit``).

Sources (``prompts.edit.source``):

* ``seeded``: latents drawn from ``torch.Generator(cpu)`` keyed by (``prompts.edit.seed``, sample), on
  the grid of ``prompts.edit.sizes[i % len(sizes)]`` (pixels, sides multiples of 16): no VAE needed;
* ``latents``: a safetensors file (``latents.{k}`` ``(h·w, C)``, ``grid.{k}`` ``(2,)``; what
  ``pipelines.edit_inputs`` writes from a folder of pictures); sample ``i`` takes entry ``i % K``;
* ``folder``: pictures VAE-encoded into such a file before the run starts (``mmdit-strict run`` does it;
  a bare rollout refuses the source and names the file form).

The rollout records each sample's latents (``condition.{i}``) and their sha256 in its artifact; the
recompute and the localizer replay those recorded bytes, never the source.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from ..config.arch import ArchConfig
from ..model.edit import ConditionImage
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


def seeded_images(sizes: Sequence[Sequence[int]], seed: int, n: int, channels: int) -> list[ConditionImage]:
    """``n`` conditioning images drawn per sample: sample ``i`` on ``sizes[i % len(sizes)]``, keyed by (seed, i)."""
    if not sizes:
        raise ValueError("prompts.edit.sizes needs at least one [height, width]")
    grids = [pixel_grid(list(s), f"prompts.edit.sizes[{k}]") for k, s in enumerate(sizes)]
    out = []
    for i in range(n):
        h, w = grids[i % len(grids)]
        g = torch.Generator().manual_seed(2_000_003 * (int(seed) + 1) + i)
        out.append(ConditionImage(torch.randn(h * w, channels, generator=g), (h, w)))
    return out


def write_latents_file(path: str | Path, images: Sequence[ConditionImage], metadata: dict[str, str] | None = None) -> Path:
    """Save conditioning latents as ``latents.{k}`` (FP32) and ``grid.{k}`` (int64) for ``source=latents``."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for k, im in enumerate(images):
        tensors[f"latents.{k}"] = im.latents.detach().to("cpu", torch.float32).contiguous()
        tensors[f"grid.{k}"] = torch.tensor(list(im.grid), dtype=torch.int64)
    path = Path(path)
    save_file(tensors, str(path), metadata=metadata)
    return path


def read_latents_file(path: str | Path, channels: int) -> list[ConditionImage]:
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
        grid = tuple(int(v) for v in data[f"grid.{k}"].tolist())
        lat = data[f"latents.{k}"]
        if len(grid) != 2 or lat.dim() != 2 or lat.shape[1] != channels:
            raise ValueError(f"{path}: latents.{k} must be (h·w, {channels}) with grid.{k} = [h, w], "
                             f"got {tuple(lat.shape)} and {list(grid)}")
        if not torch.isfinite(lat).all():
            raise ValueError(f"{path}: latents.{k} contains NaN or Inf")
        out.append(ConditionImage(lat.to(torch.float32), grid))  # type: ignore[arg-type]
        k += 1
    if not out:
        raise ValueError(f"{path} holds no conditioning latents (expected latents.0, grid.0, ...)")
    return out


def make_images(edit: Any, n: int, arch: ArchConfig) -> list[ConditionImage] | None:
    """The ``n`` samples' conditioning images of ``prompts.edit`` (None for text-to-image), FP32 on the CPU."""
    source = edit.source
    if source is None:
        return None
    if source not in SOURCES:
        raise ValueError(f"prompts.edit.source must be one of {list(SOURCES)} or null, got {source!r}")
    if source == "seeded":
        return seeded_images(list(edit.sizes), int(edit.seed), n, arch.in_channels)
    if source == "folder":
        raise ValueError("prompts.edit.source=folder is encoded by `mmdit-strict run` before the rollout; here pass the "
                         "encoded file as prompts.edit.source=latents prompts.edit.latents=FILE")
    if not edit.latents:
        raise ValueError("prompts.edit.source=latents needs prompts.edit.latents=FILE (safetensors of latents.{k}, grid.{k})")
    table = read_latents_file(edit.latents, arch.in_channels)
    return [table[i % len(table)] for i in range(n)]


def image_hashes(images: Sequence[ConditionImage]) -> list[dict[str, Any]]:
    """Per sample: the conditioning grid and the sha256 of its FP32 latents."""
    return [{"grid": list(im.grid), "sha256": tensor_sha256(im.latents.detach().to("cpu", torch.float32))} for im in images]

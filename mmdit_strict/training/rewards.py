"""Reward functions for GRPO training: a registry, built-ins that need no downloads, weighted sums.

Contract of a reward function: ``fn(inputs, prompts, metadata, **kwargs) -> scores`` where

* ``inputs`` is what the function declares it wants (``@register_reward(name, takes=...)``):
  ``"images"``: ``(B, H, W, 3)`` uint8 tensor (CPU), or ``"latents"``: ``(B, 16, 2h, 2w)`` FP32
  unpacked final latents (CPU; the model's normalised latent space);
* ``prompts``: ``B`` prompt strings (the prompt text, or ``"prompt <i>"`` for synthetic embeddings);
* ``metadata``: ``B`` dicts (``prompt_id``, ``sample_id``, ``epoch``, ...);
* ``scores``: ``B`` finite floats (a sequence, numpy array or tensor), higher is better.

A plug-in is named ``"package.module:function"`` in ``train.reward_fn``; it receives images unless it
carries an attribute ``takes = "latents"``.

Images come from :class:`ImageSource`: the VAE when the checkpoint is a pipeline folder with one,
otherwise a fixed latent→RGB preview (the tiny default has no VAE).
"""

from __future__ import annotations

import importlib
import io
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

Scores = Sequence[float]
RewardFn = Callable[..., Any]

_REGISTRY: dict[str, "RewardSpec"] = {}


@dataclass(frozen=True)
class RewardSpec:
    """One reward function and what it wants as input (``images`` or ``latents``)."""

    name: str
    fn: RewardFn
    takes: str


def register_reward(name: str, takes: str = "images") -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn`` under ``name``; ``takes`` is ``"images"`` or ``"latents"``."""
    if takes not in ("images", "latents"):
        raise ValueError(f"takes must be 'images' or 'latents', got {takes!r}")

    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} is already registered")
        _REGISTRY[name] = RewardSpec(name, fn, takes)
        return fn

    return deco


def available_rewards() -> list[str]:
    return sorted(_REGISTRY)


def resolve_reward(name: str) -> RewardSpec:
    """A registered name, or ``"module:function"`` imported on demand."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" not in name:
        raise ValueError(f"unknown reward {name!r}; registered: {available_rewards()} (or give 'package.module:function')")
    mod_name, _, fn_name = name.partition(":")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ValueError(f"reward plug-in {name!r}: cannot import {mod_name}: {exc}") from exc
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward plug-in {name!r}: {mod_name} has no callable {fn_name!r}")
    takes = getattr(fn, "takes", "images")
    if takes not in ("images", "latents"):
        raise ValueError(f"reward plug-in {name!r}: attribute takes must be 'images' or 'latents', got {takes!r}")
    return RewardSpec(name, fn, takes)


# ----------------------------------------------------------------------------------------------
# latents → images
# ----------------------------------------------------------------------------------------------


class ImageSource:
    """Final packed latents → ``(B, H, W, 3)`` uint8 images (CPU tensor).

    With ``vae`` (the ``AutoencoderKLQwenImage`` of the checkpoint's pipeline folder): diffusers'
    decode (``pipelines.vae.decode``, 16 pixels per token). Without: the fixed latent→RGB preview
    (``pipelines.vae.preview_rgb``, one pixel per latent cell) upsampled ``upscale``× with
    nearest-neighbour, so JPEG sizes are of pixel-sized images (8 = the VAE's factor).
    """

    def __init__(self, vae: Any | None = None, upscale: int = 8) -> None:
        self.vae = vae
        self.upscale = int(upscale)
        self.kind = "vae" if vae is not None else "preview"

    def __call__(self, packed: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        from ..pipelines.vae import decode, preview_rgb

        if self.vae is not None:
            return torch.from_numpy(decode(self.vae, packed, grid))
        img = torch.from_numpy(preview_rgb(packed, grid))
        if self.upscale > 1:
            img = img.repeat_interleave(self.upscale, dim=1).repeat_interleave(self.upscale, dim=2)
        return img


def unpack_final(packed: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Packed ``(B, h·w, 64)`` latents → ``(B, 16, 2h, 2w)`` FP32 on the CPU (diffusers' unpack order)."""
    from ..pipelines.vae import unpack_latents

    return unpack_latents(packed.detach().to("cpu", torch.float32), grid)[:, :, 0]


# ----------------------------------------------------------------------------------------------
# built-ins
# ----------------------------------------------------------------------------------------------


def _jpeg_kb(images: torch.Tensor, quality: int) -> list[float]:
    from PIL import Image

    sizes = []
    for img in images:
        buf = io.BytesIO()
        Image.fromarray(img.numpy()).save(buf, format="JPEG", quality=int(quality))
        sizes.append(buf.tell() / 1000.0)
    return sizes


@register_reward("jpeg_compressibility", takes="images")
def jpeg_compressibility(images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict], quality: int = 95) -> list[float]:
    """Flow-GRPO's JPEG compressibility: minus the JPEG size in kB at ``quality`` (smaller file = higher reward)."""
    return [-s for s in _jpeg_kb(images, quality)]


@register_reward("jpeg_incompressibility", takes="images")
def jpeg_incompressibility(images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict], quality: int = 95) -> list[float]:
    """The JPEG size in kB at ``quality`` (larger file = higher reward)."""
    return _jpeg_kb(images, quality)


@register_reward("latent_stats", takes="latents")
def latent_stats(latents: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict],
                 mean: float = 0.5, std: float | None = None) -> list[float]:
    """Minus the distance of each sample's latent statistics to a target.

    ``score = -|mean(z) - mean|`` (FP64 over all of the sample's values), minus ``|std(z) - std|``
    when a target ``std`` is given.
    """
    z = latents.detach().to("cpu", torch.float64).flatten(1)
    score = -(z.mean(dim=1) - float(mean)).abs()
    if std is not None:
        score = score - (z.std(dim=1) - float(std)).abs()
    return score.tolist()


# ----------------------------------------------------------------------------------------------
# weighted sums
# ----------------------------------------------------------------------------------------------


class RewardSet:
    """Weighted sum of rewards; each is also reported on its own."""

    def __init__(self, weights: Mapping[str, float], kwargs: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        kwargs = dict(kwargs or {})
        unknown = sorted(set(kwargs) - set(weights))
        if unknown:
            raise ValueError(f"train.reward_kwargs names rewards not in train.reward_fn: {unknown}")
        weights = {n: w for n, w in weights.items() if float(w) != 0.0}  # weight 0 switches a reward off
        if not weights:
            raise ValueError("train.reward_fn names no reward with a non-zero weight: pick a train group (train=tiny, train=flow_grpo), an experiment (experiment=grpo_tiny, experiment=grpo_edit_tiny) or add one (+train.reward_fn.jpeg_compressibility=1.0)")
        kwargs = {n: k for n, k in kwargs.items() if n in weights}
        self.specs = [resolve_reward(str(n)) for n in weights]
        self.weights = {str(n): float(w) for n, w in weights.items()}
        self.kwargs = {str(n): dict(k) for n, k in kwargs.items()}
        for n, w in self.weights.items():
            if not math.isfinite(w):
                raise ValueError(f"reward weight for {n!r} must be finite, got {w}")

    def __call__(self, packed: torch.Tensor, grid: tuple[int, int], prompts: Sequence[str], metadata: Sequence[dict],
                 images: ImageSource | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``packed``: final latents ``(B, h·w, 64)``; ``images`` decodes them for image rewards (default: the preview).

        Returns (weighted total ``(B,)`` FP64, per-reward ``(B,)`` FP64).
        """
        B = packed.shape[0]
        source = images if images is not None else ImageSource()
        decoded = latents = None
        parts: dict[str, torch.Tensor] = {}
        for spec in self.specs:
            if spec.takes == "images":
                decoded = source(packed, grid) if decoded is None else decoded
                arg = decoded
            else:
                latents = unpack_final(packed, grid) if latents is None else latents
                arg = latents
            out = spec.fn(arg, list(prompts), list(metadata), **self.kwargs.get(spec.name, {}))
            scores = torch.as_tensor(out if not isinstance(out, torch.Tensor) else out.detach().cpu(), dtype=torch.float64).reshape(-1)
            if scores.shape[0] != B:
                raise ValueError(f"reward {spec.name!r} returned {scores.shape[0]} scores for {B} samples")
            if not torch.isfinite(scores).all():
                raise ValueError(f"reward {spec.name!r} returned NaN or Inf")
            parts[spec.name] = scores
        total = torch.zeros(B, dtype=torch.float64)
        for name, scores in parts.items():
            total = total + self.weights[name] * scores
        return total, parts


__all__ = ["register_reward", "resolve_reward", "available_rewards", "RewardSet", "RewardSpec", "ImageSource",
           "unpack_final", "jpeg_compressibility", "jpeg_incompressibility", "latent_stats"]


def reward_problems(cfg: Any) -> list[str]:
    """Compose-time check of a ``train`` config: the rewards resolve (built-in names, importable plug-ins)
    with finite weights and known kwargs; one sentence per problem, empty when usable."""
    from omegaconf import OmegaConf

    try:
        RewardSet(OmegaConf.to_container(cfg.train.reward_fn), OmegaConf.to_container(cfg.train.reward_kwargs))
    except ValueError as exc:
        return [str(exc)]
    return []


def compose_train(overrides: Sequence[str] = (), config_dir: Any = None) -> Any:
    """The config ``mmdit-strict train`` runs: the ``train`` schema composed from ``overrides``, validated with
    the reward check (which needs the reward registry, so it lives here rather than in ``config``)."""
    from ..config.compose import compose

    return compose(overrides, config_dir=config_dir, command="train", checks=(reward_problems,))

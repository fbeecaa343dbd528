"""Reward functions for GRPO training: a registry, built-ins that need no downloads, weighted sums.

Contract of a reward function: ``fn(inputs, prompts, metadata, **kwargs) -> scores`` where

* ``inputs`` is what the function declares it wants (``@register_reward(name, takes=...)``):
  ``"images"``: ``(B, H, W, 3)`` uint8 tensor (CPU), or ``"latents"``: ``(B, 16, h, w)`` FP32
  unpacked final latents (CPU; the model's normalised latent space);
* ``prompts``: ``B`` prompt strings (the prompt text, or ``"prompt <i>"`` for synthetic embeddings);
* ``metadata``: ``B`` dicts (``prompt_id``, ``sample_id``, ``epoch``, ...);
* ``scores``: ``B`` finite floats (a sequence, numpy array or tensor), higher is better.

A plug-in is named ``"package.module:function"`` in ``train.reward_fn``; it receives images unless it
carries an attribute ``takes = "latents"``.

Images come from :func:`preview_rgb`, a fixed linear latent→RGB projection (the tiny default has no
VAE), upsampled by the VAE factor 8 with nearest-neighbour so the JPEG sizes are of pixel-sized images.
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

#: Fixed 16-channel → RGB weights of the preview (rows R, G, B): each colour is a signed mix of
#: channel groups, chosen so independent unit-variance channels give colours of similar spread.
_PREVIEW_W = torch.tensor([
    [0.35, 0.30, 0.25, 0.20, -0.10, -0.05, 0.00, 0.05, 0.10, 0.00, -0.05, 0.05, 0.00, 0.10, 0.00, 0.05],
    [0.05, -0.05, 0.10, 0.00, 0.35, 0.30, 0.25, 0.20, -0.10, 0.05, 0.00, -0.05, 0.10, 0.00, 0.05, 0.00],
    [0.00, 0.05, -0.05, 0.10, 0.00, 0.05, -0.10, 0.00, 0.35, 0.30, 0.25, 0.20, 0.05, -0.05, 0.10, 0.05],
], dtype=torch.float32)


def unpack_final(x: torch.Tensor, grid: tuple[int, int], patch: int = 2) -> torch.Tensor:
    """Packed ``(B, h*w, 16*p*p)`` latents → ``(B, 16, h*p, w*p)`` (diffusers' unpack order)."""
    B, T, C = x.shape
    h, w = grid
    if T != h * w or C % (patch * patch):
        raise ValueError(f"expected packed latents (B, {h * w}, 16·{patch}²), got {tuple(x.shape)}")
    c = C // (patch * patch)
    return x.reshape(B, h, w, c, patch, patch).permute(0, 3, 1, 4, 2, 5).reshape(B, c, h * patch, w * patch)


def preview_rgb(latents: torch.Tensor, upscale: int = 8) -> torch.Tensor:
    """``(B, 16, h, w)`` FP32 latents → ``(B, h·upscale, w·upscale, 3)`` uint8 via the fixed projection.

    ``rgb = 255 · (0.5 + 0.5 · tanh(W z))`` per latent pixel, rounded, then nearest-neighbour upsampling.
    """
    if latents.dim() != 4 or latents.shape[1] != _PREVIEW_W.shape[1]:
        raise ValueError(f"preview_rgb expects (B, 16, h, w) latents, got {tuple(latents.shape)}")
    z = latents.detach().to("cpu", torch.float32)
    rgb = torch.einsum("oc,bchw->bhwo", _PREVIEW_W, z)
    img = torch.round(255.0 * (0.5 + 0.5 * torch.tanh(rgb))).clamp(0, 255).to(torch.uint8)
    if upscale > 1:
        img = img.repeat_interleave(upscale, dim=1).repeat_interleave(upscale, dim=2)
    return img


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
            raise ValueError("train.reward_fn names no reward with a non-zero weight: pick a train group (train=tiny, train=flow_grpo), an experiment (experiment=grpo_tiny) or add one (+train.reward_fn.jpeg_compressibility=1.0)")
        kwargs = {n: k for n, k in kwargs.items() if n in weights}
        self.specs = [resolve_reward(str(n)) for n in weights]
        self.weights = {str(n): float(w) for n, w in weights.items()}
        self.kwargs = {str(n): dict(k) for n, k in kwargs.items()}
        for n, w in self.weights.items():
            if not math.isfinite(w):
                raise ValueError(f"reward weight for {n!r} must be finite, got {w}")

    def __call__(self, latents: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``latents``: ``(B, 16, h, w)``. Returns (weighted total ``(B,)`` FP64, per-reward ``(B,)`` FP64)."""
        B = latents.shape[0]
        images = None
        parts: dict[str, torch.Tensor] = {}
        for spec in self.specs:
            if spec.takes == "images":
                images = preview_rgb(latents) if images is None else images
                arg = images
            else:
                arg = latents.detach().to("cpu", torch.float32)
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


__all__ = ["register_reward", "resolve_reward", "available_rewards", "RewardSet", "RewardSpec", "preview_rgb",
           "unpack_final", "jpeg_compressibility", "jpeg_incompressibility", "latent_stats"]

"""Keyed noise: initial latents and SDE noise, one independent stream per (seed, sample, step, purpose).

docs/design.md §3.8: noise is never drawn from a shared stream, so batching, batch order and batch
composition never change which noise a sample gets.

Pins (changing any of them changes every trajectory; they are part of the trajectory contract):

* Key: ``noise_key(seed, sample_id, step, purpose)`` = the first 8 bytes (big-endian) of
  ``sha256("mmdit_strict.noise.v1|seed=<seed>|sample=<sample_id>|step=<step>|purpose=<purpose>")``
  (UTF-8, decimal integers), masked to 63 bits.
* Generator: a fresh ``torch.Generator(device="cpu")`` per sample, ``manual_seed(key)``.
* Draw: exactly one ``torch.randn(shape_per_sample, generator=g, dtype=torch.float32, device="cpu")``
  per sample (torch's CPU normal sampler; the bytes are pinned to the torch version, which the
  trajectory records).
* Assembly: per-sample tensors stacked in the order of ``sample_ids``, then one copy to ``device``
  and one cast to ``dtype`` (a no-op for the default FP32).
* Purposes: ``"initial_latents"`` (step 0) for :func:`initial_latents`, ``"sde"`` for
  :func:`step_noise`.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from ._checks import check_int

__all__ = ["noise_key", "initial_latents", "step_noise", "KEY_VERSION"]

KEY_VERSION = "mmdit_strict.noise.v1"
_MASK63 = (1 << 63) - 1


def noise_key(seed: int, sample_id: int, step: int, purpose: str) -> int:
    """63-bit generator seed for one (seed, sample, step, purpose); see the module docstring."""
    check_int("seed", seed, 0)
    check_int("sample_id", sample_id, 0)
    check_int("step", step, 0)
    if not isinstance(purpose, str) or not purpose or "|" in purpose or "=" in purpose:
        raise ValueError(f"purpose must be a non-empty string without '|' or '=', got {purpose!r}")
    text = f"{KEY_VERSION}|seed={seed}|sample={sample_id}|step={step}|purpose={purpose}"
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") & _MASK63


def _check_shape(shape_per_sample: Sequence[int]) -> tuple[int, ...]:
    try:
        shape = tuple(shape_per_sample)
    except TypeError:
        raise TypeError(f"shape_per_sample must be a sequence of ints, got {shape_per_sample!r}") from None
    if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"shape_per_sample must be a non-empty sequence of positive ints, got {shape_per_sample!r}")
    return shape


def _check_ids(sample_ids: Sequence[int]) -> list[int]:
    ids = list(sample_ids)
    if not ids:
        raise ValueError("sample_ids is empty")
    for i in ids:
        check_int("sample_id", i, 0)
    return ids


def _draw(seed: int, ids: list[int], step: int, purpose: str, shape: tuple[int, ...]) -> torch.Tensor:
    rows = []
    for sid in ids:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(noise_key(seed, sid, step, purpose))
        rows.append(torch.randn(shape, generator=gen, dtype=torch.float32, device="cpu"))
    return torch.stack(rows)


def initial_latents(
    seed: int,
    sample_ids: Sequence[int],
    shape_per_sample: Sequence[int],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Initial noise ``(len(sample_ids), *shape_per_sample)``; sample ``i`` depends only on ``(seed, sample_ids[i])``.

    Args:
        seed: run seed, ``>= 0``.
        sample_ids: logical sample ids (duplicates get identical noise).
        shape_per_sample: e.g. ``(tokens, 64)`` packed or ``(16, H, W)`` unpacked.
        device: target device (the draw is always on the CPU).
        dtype: output dtype (drawn in FP32, cast once).
    """
    check_int("seed", seed, 0)
    ids = _check_ids(sample_ids)
    shape = _check_shape(shape_per_sample)
    return _draw(seed, ids, 0, "initial_latents", shape).to(device=device, dtype=dtype)


def step_noise(
    seed: int,
    sample_ids: Sequence[int],
    step: int,
    shape_per_sample: Sequence[int],
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """FP32 standard-normal SDE noise for denoising step ``step`` (0-based), ``(len(sample_ids), *shape_per_sample)``.

    Sample ``i`` depends only on ``(seed, sample_ids[i], step)``.
    """
    check_int("seed", seed, 0)
    check_int("step", step, 0)
    ids = _check_ids(sample_ids)
    shape = _check_shape(shape_per_sample)
    return _draw(seed, ids, step, "sde", shape).to(device=device)

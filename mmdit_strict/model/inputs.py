"""Random forward inputs in diffusers' argument names (benchmarks, analyses, examples)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..config.arch import ArchConfig


def random_inputs(
    arch: ArchConfig, grid: tuple[int, int], txt_lens: Sequence[int], *, pad_to: int | None = None,
    sigmas: Sequence[float] | None = None, seed: int = 0,
) -> dict[str, Any]:
    """Inputs for ``MMDiT.forward``: one sample per entry of ``txt_lens`` (its valid prompt tokens).

    Prompts are padded to ``pad_to`` (default: the longest) with random values the prefix mask
    excludes; sigmas default to an even spread over [0.1, 0.9].
    """
    batch = len(txt_lens)
    g = torch.Generator().manual_seed(seed)
    h, w = grid
    L = pad_to if pad_to is not None else max(txt_lens)
    if L < max(txt_lens):
        raise ValueError(f"pad_to={L} is shorter than the longest prompt ({max(txt_lens)} tokens)")
    mask = torch.zeros(batch, L, dtype=torch.long)
    for b, n in enumerate(txt_lens):
        mask[b, :n] = 1
    sig = torch.tensor(list(sigmas), dtype=torch.float32) if sigmas is not None else (
        torch.linspace(0.9, 0.1, batch) if batch > 1 else torch.tensor([0.6]))
    return {
        "hidden_states": torch.randn(batch, h * w, arch.in_channels, generator=g),
        "encoder_hidden_states": torch.randn(batch, L, arch.joint_attention_dim, generator=g),
        "encoder_hidden_states_mask": mask,
        "timestep": sig,
        "img_shapes": [[(1, h, w)]] * batch,
    }

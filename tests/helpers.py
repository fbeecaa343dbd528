"""Test helpers: checkpoint writers and input builders (no reference math lives here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

TINY_DIFFUSERS_KWARGS: dict[str, Any] = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=48, axes_dims_rope=(4, 6, 6),
)


def make_diffusers_checkpoint(path: Path, seed: int = 0, max_shard_size: str | None = None, **kwargs: Any):
    """Build diffusers' QwenImageTransformer2DModel with random non-trivial weights and save it."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(**kwargs).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    save_kwargs = {"safe_serialization": True}
    if max_shard_size:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(path), **save_kwargs)
    return model.eval()


def make_inputs(
    batch: int, grid: tuple[int, int], txt_lens: Sequence[int], *, txt_dim: int = 48, pad_to: int | None = None,
    seed: int = 0, dtype: torch.dtype = torch.float32, sigma: float | Sequence[float] = 0.7,
) -> dict[str, Any]:
    """Random forward inputs in diffusers' argument names (prefix masks, per-sample lengths)."""
    g = torch.Generator().manual_seed(seed)
    h, w = grid
    L = pad_to if pad_to is not None else max(txt_lens)
    hs = torch.randn(batch, h * w, 64, generator=g).to(dtype)
    ehs = torch.randn(batch, L, txt_dim, generator=g).to(dtype)
    mask = torch.zeros(batch, L, dtype=torch.long)
    for b, n in enumerate(txt_lens):
        mask[b, :n] = 1
    sig = torch.tensor(sigma if isinstance(sigma, (list, tuple)) else [sigma] * batch, dtype=torch.float32)
    return dict(
        hidden_states=hs, encoder_hidden_states=ehs, encoder_hidden_states_mask=mask,
        timestep=sig.to(dtype), img_shapes=[[(1, h, w)]] * batch,
    )


def strict_qwen_image_cuda(num_layers: int) -> tuple[Any, torch.nn.Module]:
    """(arch, model): Qwen-Image's widths with ``num_layers`` blocks, built with seed 0 for the strict runtime
    in BF16 on CUDA. Skips the calling test when there is no CUDA device."""
    import dataclasses

    import pytest

    from mmdit_strict.config.arch import preset
    from mmdit_strict.model.init import build_model

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    arch = dataclasses.replace(preset("qwen-image"), num_layers=num_layers)
    return arch, build_model(arch, seed=0, runtime="strict", dtype=torch.bfloat16, device="cuda")

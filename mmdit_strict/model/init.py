"""Deterministic random initialisation for the embedded tiny default (no checkpoint needed)."""

from __future__ import annotations

import torch

from .mmdit import MMDiT


@torch.no_grad()
def init_weights(model: MMDiT, seed: int = 0, std: float = 0.05) -> MMDiT:
    """Fill every parameter from a CPU generator keyed by ``seed``, in state-dict order.

    Weights ~ N(0, std²) scaled by 1/sqrt(fan_in/64) so activations stay O(1) at any width; biases
    ~ N(0, (std/2)²); norm gains ~ 1 + N(0, 0.1²). Same seed → same bytes on every machine.
    """
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if name.endswith("norm.weight") or ".norm_" in name and name.endswith("weight"):
            val = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float32)
        elif name.endswith("bias"):
            val = 0.5 * std * torch.randn(shape, generator=gen, dtype=torch.float32)
        else:
            fan_in = shape[-1] if len(shape) > 1 else 1
            val = std * (64.0 / max(fan_in, 64)) ** 0.5 * torch.randn(shape, generator=gen, dtype=torch.float32)
        p.copy_(val.to(p.dtype))
    return model


def build_model(arch, *, seed: int = 0, runtime: str = "off", dtype: torch.dtype = torch.float32, device: str = "cpu") -> MMDiT:
    """A randomly initialised model of ``arch`` (deterministic in ``seed``)."""
    model = MMDiT(arch, runtime=runtime)
    init_weights(model, seed)
    return model.to(device=device, dtype=dtype).eval()

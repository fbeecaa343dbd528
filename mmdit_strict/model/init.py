"""Deterministic random initialisation (the embedded tiny default, and random-weight GPU runs)."""

from __future__ import annotations

import torch

from .mmdit import MMDiT


def _draw(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32, device=device)


@torch.no_grad()
def init_weights(model: MMDiT, seed: int = 0, std: float = 0.05) -> MMDiT:
    """Fill every parameter from a generator keyed by ``seed``, in state-dict order.

    Weights ~ N(0, std²) scaled by 1/sqrt(fan_in/64) so activations stay O(1) at any width; biases
    ~ N(0, (std/2)²); norm gains ~ 1 + N(0, 0.1²). Values are drawn in FP32 and rounded once to the
    parameter dtype. The generator lives on the parameters' device: a CPU model gets the same bytes on
    every machine; a CUDA model is drawn on the GPU (CUDA's Philox generator, deterministic in the seed
    on any GPU) so a 20 B model initialises in seconds — its values differ from the CPU draw.
    """
    device = model.device
    gen = torch.Generator(device=device).manual_seed(int(seed))
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if name.endswith("norm.weight") or ".norm_" in name and name.endswith("weight"):
            val = 1.0 + 0.1 * _draw(shape, gen, device)
        elif name.endswith("bias"):
            val = 0.5 * std * _draw(shape, gen, device)
        else:
            fan_in = shape[-1] if len(shape) > 1 else 1
            val = std * (64.0 / max(fan_in, 64)) ** 0.5 * _draw(shape, gen, device)
        p.copy_(val.to(p.dtype))
    return model


def build_model(arch, *, seed: int = 0, runtime: str = "off", dtype: torch.dtype = torch.float32, device: str = "cpu") -> MMDiT:
    """A randomly initialised model of ``arch`` (deterministic in ``seed`` and the device type).

    On CUDA the parameters are allocated directly on the GPU in ``dtype`` (no FP32 host copy) and drawn
    there; on the CPU they are drawn in FP32 and cast.
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        model = MMDiT(arch, runtime=runtime)
        init_weights(model, seed)
        return model.to(dtype=dtype).eval()
    with torch.device("meta"):
        model = MMDiT(arch, runtime=runtime)
    model = model.to(dtype=dtype).to_empty(device=dev)
    init_weights(model, seed)
    return model.eval()

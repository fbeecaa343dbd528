"""Run the strict model's Triton kernels on the CPU under the interpreter (FP32): a test registers the Triton
implementations for the CPU, so a whole tiny-model step goes through the GPU's kernels and their caches."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from mmdit_strict.config.arch import preset
from mmdit_strict.config.schema import LoraConfig
from mmdit_strict.kernels import registry
from mmdit_strict.model.init import build_model
from mmdit_strict.trajectories.setup import attach_lora


def triton_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolve every operator that has a Triton implementation to it on the CPU (FP32, under the interpreter)."""
    registry._ensure_loaded()
    monkeypatch.setattr(registry, "_RESOLVED", {})
    monkeypatch.setattr(registry, "_DISPATCH", {})
    moved = 0
    for (op, dev, dname), impls in list(registry._REGISTRY.items()):
        tri = [i for i in impls if i.backend == "triton"]
        if dev == "cuda" and dname == "fp32" and tri:
            others = [i for i in registry._REGISTRY.get((op, "cpu", dname), []) if not i.strict]  # production stays
            monkeypatch.setitem(registry._REGISTRY, (op, "cpu", dname), tri + others)
            moved += 1
    assert moved >= 10


def tiny_lora_model(num_layers: int, checkpointing: bool = True) -> tuple[Any, Any, list[torch.Tensor]]:
    """``(arch, model, trainable)``: the tiny strict model (FP32, CPU) with ``num_layers`` blocks and a random rank-4
    LoRA on Flow-GRPO's targets, only the LoRA trainable."""
    arch = dataclasses.replace(preset("tiny"), num_layers=num_layers)
    model = build_model(arch, seed=0, runtime="strict", dtype=torch.float32, device="cpu")
    attach_lora(model, LoraConfig(rank=4, alpha=8.0, init="random", seed=3))
    model.requires_grad_(False)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    model.enable_gradient_checkpointing(checkpointing)
    return arch, model, [p for p in model.parameters() if p.requires_grad]

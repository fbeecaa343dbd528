"""Run the strict model's Triton kernels on the CPU under the interpreter (FP32): a test registers the Triton
implementations for the CPU, so a whole tiny-model step goes through the GPU's kernels and their caches."""

from __future__ import annotations

import pytest

from mmdit_strict.kernels import registry


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

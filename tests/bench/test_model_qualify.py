"""The whole-model qualification runs its byte checks on the CPU strict backend (tiny preset) and reports full counts."""

from __future__ import annotations

import json

import torch

from mmdit_strict.bench import model_qualify as mq


def test_tiny_model_passes_every_byte_check(tmp_path) -> None:
    rc = mq.main(["--out", str(tmp_path), "--preset", "tiny", "--layers", "0", "--device", "cpu", "--dtype", "float32",
                  "--shapes", "4x4", "3x5", "--lora-rank", "2", "--quiet"])
    report = json.loads((tmp_path / "model_qualify.json").read_text())
    assert rc == 0 and mq.passed(report)
    assert set(report["checks"]) == {"batch", "padding", "cfg", "repeats", "checkpointing"}
    # 8 samples x (B=2 and B=3 at every shift, one B=8 batch) per grid, two grids
    assert report["checks"]["batch"]["compared"] == 2 * (2 * 8 + 3 * 8 + 8)
    assert report["fallbacks"] == [] and "joint_attention_fused" in report["operators"]
    assert "| batch | 96 | 96 |" in (tmp_path / "model_qualify.md").read_text()


def test_counter_counts_a_one_ulp_difference_and_skips_absent_gradients() -> None:
    c = mq.Counter()
    a = torch.ones(3)
    c.compare("x", a, a.clone(), "same")
    c.compare("x", a, torch.nextafter(a, torch.full_like(a, 2.0)), "one ulp")
    c.compare("x", None, a, "missing on one side")
    c.compare("x", None, None, "neither side")
    assert c.counts["x"] == [1, 3] and len(c.mismatches) == 2
    assert not mq.passed({"fallbacks": [], "checks": {"x": {"equal": 1, "compared": 3}}})

"""bench.norms and benchmarks.norms_tune render every section of their reports (no GPU needed: hand-made reports)."""

from __future__ import annotations

from mmdit_strict.bench import norms


def test_norms_report_renders_all_sections() -> None:
    report = {
        "env": {"gpu": "H200", "driver": "1", "torch": "t", "triton": "3.6", "cuda": "13", "commit": "abc", "date_utc": "now"},
        "accuracy": [{"op": "adaln_modulation", "dtype": "bf16", "rows": 4096, "tensor": "out", "max_abs": 0.03, "max_ref": 11.0,
                      "rel_fro": 1.6e-3, "torch_max_abs": 0.09, "pass": True}],
        "invariance": [{"op": "qk_rmsnorm", "dtype": "fp32", "probe_rows": 4096, "companion_rows": [1, 1024], "checked": 10,
                        "equal": 9, "pass": False, "failures": ["B=2 probe@0 sample 0@0 tensor 1"]}],
        "speed": [{"op": "multi_axis_rope", "dtype": "bf16", "rows": 4096, "fwd_ms": 0.02, "fwd_gbps": 2500.0, "fwd_copy_gbps": 3000.0,
                   "fwd_fraction": 0.83, "torch_fwd_ms": 0.05, "fwd_speedup_vs_torch": 2.5}],
        "model_trace": {"layers": 2, "grid": [32, 32], "txt_lens": [77, 5], "dtype": "bfloat16", "forward": [],
                        "forward+backward": ["joint_attention_fused -> torch"], "forward_backends": ["qk_rmsnorm: triton"]},
        "errors": ["speed x: skipped"], "wall_s": 12.0,
    }
    md = norms.render(report)
    assert "(1/1 pass)" in md and "(9/10 tensors equal)" in md and "| 1..1024 | 9/10 |" in md
    assert "2500 (3000, 0.83)" in md and "| 2.50 |" in md
    assert "forward fallbacks: none" in md and "joint_attention_fused -> torch" in md and "- speed x: skipped" in md


def test_norms_report_renders_tune() -> None:
    """The launch-candidate table: fractions, the reference marked, byte equality counted."""
    row = {"kernel": "adaln_modulation fwd", "dtype": "bf16", "rows": 4096, "launch": "fwd rows 4", "reference": True,
           "ms": 0.02, "bytes": 1, "equal_reference": True, "gbps": 3000.0, "copy_gbps": 4000.0, "fraction": 0.75}
    from benchmarks import norms_tune

    md = norms_tune.render({"env": {}, "tune": [row, {**row, "reference": False, "equal_reference": False}], "errors": [], "wall_s": 1.0})
    assert "(1/2 byte-equal to the reference launch)" in md and "fwd rows 4 (reference)" in md and "3000 (4000, 0.75)" in md
    assert "| NO |" in md

"""bench.norms renders every section of its report (no GPU needed: a hand-made report)."""

from __future__ import annotations

import torch

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


def test_norms_report_renders_variants() -> None:
    """Rows of a non-default kernel variant are labelled, and the variant-bytes table says what differed."""
    report = {
        "env": {"variants": ["default", "chunk_heads"]},
        "accuracy": [], "invariance": [],
        "speed": [{"op": "qk_rmsnorm", "dtype": "bf16", "rows": 4096, "bwd_ms": 0.05, "variant": "default"},
                  {"op": "qk_rmsnorm", "dtype": "bf16", "rows": 4096, "bwd_ms": 0.03, "variant": "chunk_heads"}],
        "variant_bytes": [{"op": "qk_rmsnorm", "dtype": "fp32", "variant": "chunk_heads", "seqlens": [4096, 0], "pass": True,
                           "tensors": [{"tensor": "out", "equal": True, "max_abs_diff": 0.0, "may_differ": False},
                                       {"tensor": "d_shared0", "equal": False, "max_abs_diff": 3e-5, "may_differ": True}]}],
        "errors": [], "wall_s": 1.0,
    }
    md = norms.render(report)
    assert "| qk_rmsnorm | bf16 | 4096 |" in md and "| qk_rmsnorm [chunk_heads] | bf16 | 4096 |" in md
    assert "kernel variants default, chunk_heads" in md and "(1/1 pass)" in md and "d_shared0* (3.00e-05)" in md


def test_norms_variants_name_the_library_settings() -> None:
    """Every bench variant names launch settings the kernel modules hold, and the default is the library's default."""
    from mmdit_strict.kernels.triton import norms as N
    from mmdit_strict.kernels.triton import rope as R

    def current(dt):
        return R.current_qk_bwd_launch(dt, 24), N.current_ln_launch(dt)

    assert norms.VARIANTS["default"] == norms.Variant()
    for dt in (torch.bfloat16, torch.float32):
        defaults = (R.QK_BWD_DEFAULTS[dt, False], N.LN_DEFAULTS[dt])
        for name, v in norms.VARIANTS.items():
            want = (getattr(R, v.qk) if v.qk else defaults[0], getattr(N, v.ln) if v.ln else defaults[1])
            assert want[0] in R.QK_BWD_CANDIDATES and want[1] in N.LN_CANDIDATES, name
            with norms.variant(name):
                assert current(dt) == want, name
        assert current(dt) == defaults


def test_norms_report_renders_tune() -> None:
    """The launch-candidate table: fractions, the reference marked, byte equality counted."""
    row = {"kernel": "adaln_modulation fwd", "dtype": "bf16", "rows": 4096, "launch": "fwd rows 4", "reference": True,
           "ms": 0.02, "bytes": 1, "equal_reference": True, "gbps": 3000.0, "copy_gbps": 4000.0, "fraction": 0.75}
    md = norms.render({"env": {}, "tune": [row, {**row, "reference": False, "equal_reference": False}], "errors": [], "wall_s": 1.0})
    assert "(1/2 byte-equal to the reference launch)" in md and "fwd rows 4 (reference)" in md and "3000 (4000, 0.75)" in md
    assert "| NO |" in md

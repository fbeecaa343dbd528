"""The training-step profile groups kernels by launch grid and finds the Python line behind glue kernels (CPU,
on a synthetic profiler trace)."""

from __future__ import annotations

from mmdit_strict.bench import step_profile as sp

EVENTS = [
    {"cat": "kernel", "name": "_gemm_fwd_kernel", "dur": 100.0, "args": {"grid": [132, 1, 1], "correlation": 1}},
    {"cat": "kernel", "name": "_gemm_fwd_kernel", "dur": 50.0, "args": {"grid": [132, 1, 1], "correlation": 2}},
    {"cat": "kernel", "name": "_gemm_fwd_kernel", "dur": 30.0, "args": {"grid": [12, 1, 1], "correlation": 3}},
    {"cat": "kernel", "name": "void at::native::FillFunctor", "dur": 8.0, "args": {"grid": [9, 1, 1], "correlation": 4}},
    {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1005, "tid": 7, "args": {"correlation": 4}},
    {"cat": "python_function", "name": "torch/autograd/function.py(10): apply", "ts": 990, "dur": 40, "tid": 7},
    {"cat": "python_function", "name": "mmdit_strict/model/strict.py(200): block_forward", "ts": 995, "dur": 30, "tid": 7},
    {"cat": "python_function", "name": "mmdit_strict/model/strict.py(50): other", "ts": 2000, "dur": 30, "tid": 7},
]


def test_kernels_group_by_grid_with_time_per_block() -> None:
    rows = sp.kernels_by_grid(EVENTS, layers=2, top=10)
    top = rows[0]
    assert (top["kernel"], top["grid"], top["launches"]) == ("_gemm_fwd_kernel", "[132, 1, 1]", 2)
    assert top["ms"] == 100.0 / 1e3 + 50.0 / 1e3 and top["ms_per_block"] == top["ms"] / 2
    assert rows[1]["grid"] == "[12, 1, 1]" and rows[1]["launches"] == 1


def test_glue_kernels_point_at_the_project_line_that_launched_them() -> None:
    (row,) = sp.glue_sites(EVENTS, top=10)
    assert row["site"] == "mmdit_strict/model/strict.py(200): block_forward" and row["launches"] == 1
    report = {"layers": 2, "grid": [64, 64], "txt": 128, "rank": 64, "captured_kernel_ms": 0.2, "captured_launches": 4,
              "by_grid": sp.kernels_by_grid(EVENTS, 2, 10), "glue": [row],
              "environment": {"gpu": "H200", "driver": "580", "torch": "2.11", "triton": "3.6", "commit": "abc"}}
    md = sp.render(report)
    assert "| `_gemm_fwd_kernel` | [132, 1, 1] | 0.15 | 2 | 0.075 |" in md and "block_forward" in md


def test_figure_is_redrawn_from_a_written_report_without_a_gpu(tmp_path) -> None:
    import json

    import pytest

    report = {"layers": 2, "grid": [64, 64], "txt": 128, "rank": 64, "captured_kernel_ms": 0.2, "captured_launches": 4,
              "by_grid": sp.kernels_by_grid(EVENTS, 2, 10), "glue": [], "environment": {"gpu": "H200", "commit": "abc"}}
    src = tmp_path / "step_profile.json"
    src.write_text(json.dumps(report))
    assert sp.main(["--replot", str(src)]) == 0
    assert (tmp_path / "step_profile.png").read_bytes()[:4] == b"\x89PNG"
    src.write_text(json.dumps({**report, "by_grid": []}))
    with pytest.raises(SystemExit, match="no kernel group"):
        sp.main(["--replot", str(src)])

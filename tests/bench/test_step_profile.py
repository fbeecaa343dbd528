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


GPU = [  # µs: two overlapping kernels, a 5 µs gap, a memcpy, a 250 µs gap (the host blocked), a last kernel
    {"cat": "kernel", "name": "_gemm_fwd_kernel", "ts": 0.0, "dur": 100.0},
    {"cat": "kernel", "name": "_attn_fwd_ws_kernel", "ts": 50.0, "dur": 80.0},
    {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 135.0, "dur": 15.0},
    {"cat": "kernel", "name": "_qk_fwd_kernel", "ts": 400.0, "dur": 20.0},
    {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0.0, "dur": 300.0},
    {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 350.0, "dur": 40.0},
    {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 420.0, "dur": 5.0},
]


def test_gpu_gaps_split_idle_time_by_gap_size_and_name_the_largest() -> None:
    g = sp.gpu_gaps(GPU, top=5)
    assert g["span_ms"] == 420.0 / 1e3
    assert abs(g["busy_ms"] - (130.0 + 15.0 + 20.0) / 1e3) < 1e-12  # the overlap counts once
    assert abs(g["idle_ms"] - (5.0 + 250.0) / 1e3) < 1e-12
    assert [(c["gaps"], round(c["idle_ms"] * 1e3, 6)) for c in g["classes"]] == [(1, 5.0), (0, 0.0), (1, 250.0)]
    assert g["largest"][0] == {"us": 250.0, "after": "Memcpy DtoD", "before": "_qk_fwd_kernel"}
    assert g["largest"][1] == {"us": 5.0, "after": "_attn_fwd_ws_kernel", "before": "Memcpy DtoD"}
    assert sp.gpu_gaps([], top=5)["span_ms"] == 0.0


def test_host_calls_group_runtime_calls_and_render() -> None:
    rows = sp.host_calls(GPU, top=5)
    assert (rows[0]["call"], rows[0]["calls"], rows[0]["max_ms"]) == ("cudaGraphLaunch", 2, 0.3)
    assert abs(rows[0]["ms"] - 0.34) < 1e-12
    assert rows[1]["call"] == "cudaStreamSynchronize" and rows[1]["calls"] == 1
    report = {"layers": 2, "grid": [64, 64], "txt": 128, "rank": 64, "captured_kernel_ms": 0.2, "captured_launches": 4,
              "by_grid": [], "glue": [], "captured_gaps": sp.gpu_gaps(GPU, 5), "captured_host_calls": rows,
              "environment": {"gpu": "H200", "commit": "abc"}}
    md = sp.render(report)
    assert "GPU span 0.42 ms: busy 0.17, idle 0.26" in md
    assert "| 100 µs or more | 1 | 0.250 |" in md and "| 0–10 µs | 1 | 0.005 |" in md
    assert "| 250.0 | `Memcpy DtoD` | `_qk_fwd_kernel` |" in md
    assert "| `cudaGraphLaunch` | 0.340 | 2 | 0.300 |" in md


def test_the_report_says_what_was_profiled_and_bad_batches_are_refused(capsys) -> None:
    """``--batch`` / ``--forward-only`` name the profiled step in the title, the figure's axis and the markdown; a report
    written before them reads as the B = 1 training step it was; ``--batch 0`` is refused before any GPU check."""
    import pytest

    assert sp._what({}) == "captured LoRA training step, B = 1"
    assert sp._what({"batch": 8, "backward": False}) == "captured no-grad forward, B = 8"
    report = {"layers": 2, "grid": [64, 64], "txt": 64, "rank": 64, "batch": 2, "backward": True,
              "captured_kernel_ms": 0.2, "captured_launches": 4, "by_grid": sp.kernels_by_grid(EVENTS, 2, 10), "glue": [],
              "environment": {"gpu": "H200", "commit": "abc"}}
    assert sp.render(report).startswith("# Strict captured LoRA training step, B = 2, kernel time by launch")
    with pytest.raises(SystemExit) as exc:
        sp.main(["--batch", "0"])
    assert exc.value.code == 2 and "--batch must be >= 1, got 0" in capsys.readouterr().err

"""The GPU reports' markdown renders every row kind on the CPU (a rendering error at the end of a
device run would lose its results to a traceback)."""

from __future__ import annotations

from benchmarks import gemm_sweeps, gemm_tuning
from mmdit_strict.bench import gemm


def test_gemm_report_renders_sweep_winners_and_epilogue_rows() -> None:
    cand = gemm_sweeps.ROUND5_BIG[3].as_dict()
    row = {"layer": "mlp_up", "kind": "fwd", "dtype": "bf16", "M": 4224, "config": cand, "ms": 0.5, "tflops": 650.0,
           "cublas_ms": 0.52, "ratio": 1.04, "graph_ms": 0.55, "cublas_graph_ms": 0.56, "ratio_graph": 1.02,
           "n_regs": 254, "n_spills": 0}
    no_graph = dict(row, graph_ms=None, ratio_graph=None, n_regs=None)
    report = {"env": {"gpu": "H200", "commit": "abc"}, "sweep": [row, no_graph],
              "round2_winners": {"(12288, 3072, 'bf16')": {"config": cand, "rows": [
                  {"layer": "mlp_up", "kind": "fwd", "M": 4224, "ms": 0.5, "cublas_ms": 0.52, "ratio": 1.04,
                   "graph_ms": 0.55, "cublas_graph_ms": 0.56}]}},
              "epilogue_cost": [{"layer": "mlp_up", "epilogue": "gelu_tanh", "ms": 0.5, "graph_ms": None},
                                {"layer": "mlp_up", "epilogue": "cublas addmm", "graph_ms": 0.49}]}
    md = gemm_sweeps._md(report)
    assert "128x256x64 w8 s3 g8 kn tma tma-store persistent split2" in md
    assert "0.5500 (0.5600, 1.02) | 254 / 0" in md
    assert "| — | — |" in md  # the row without graph timings or kernel stats
    assert "- gelu_tanh: do_bench 0.5000 ms, graph —" in md
    assert "- cublas addmm: do_bench —, graph 0.4900 ms" in md


def test_tuning_report_renders_errors_and_profiles() -> None:
    ok = {"layer": "qkv", "N": 9216, "K": 3072, "config": gemm_tuning.DW_CANDIDATES[2].as_dict(), "ms": 0.48, "graph_ms": 0.49,
          "cublas_ms": 0.33, "cublas_graph_ms": 0.36, "ratio_graph": 0.73}
    bad = {"layer": "qkv", "config": gemm_tuning.DW_CANDIDATES[5].as_dict(), "error": "OutOfResources: shared memory"}
    report = {"env": {}, "dw": [ok, bad], "host": [
        {"layer": "mod", "M": 8, "what": "gemm_fwd (launches)", "host_us_per_call": 144.8},
        {"layer": "mod", "M": 8, "what": "profile", "profile": "  ncalls  tottime\n"}]}
    md = gemm_tuning._md(report)
    assert "BLOCK_N=128 BLOCK_K=256 BLOCK_M=64" in md and "| 0.4800 | 0.4900 | 0.3600 | 0.73 |" in md
    assert "error: OutOfResources: shared memory" in md
    assert "- mod M=8 gemm_fwd (launches): 144.8 µs/call" in md
    assert "ncalls  tottime" in md


def test_model_bench_report_renders_times_and_errors() -> None:
    from mmdit_strict.bench import model

    ok = {"median_ms": 190.0, "min_ms": 188.0, "max_ms": 193.0, "reps": 5, "peak_gib": 41.5, "mfu": 0.47, "syncs": 0,
          "launches": 915, "vs_diffusers": 1.0, "kernel_ms": 171.0, "busy": 0.9, "host_ms": 91.5, "host_us_per_launch": 100.0,
          "idle_us_per_launch": 20.8,
          "gaps": {"classes": [{"gaps": 900, "idle_ms": 3.0}, {"gaps": 10, "idle_ms": 0.5}, {"gaps": 2, "idle_ms": 15.5}]}}
    report = {"arch_layers": 60, "grid": [64, 64], "environment": {"gpu": "H200", "driver": "580", "torch": "2.11",
              "triton": "3.6", "commit": "abc"},
              "cases": {"fwd_b1": {"txt_lens": [128], "img_tokens": 4096, "tflop": 70.6, "diffusers_eager": ok,
                                   "ours_strict": {"error": "NoStrictKernelError: no kernel"}}}}
    md = model.render(report)
    assert "| fwd_b1 | diffusers_eager | 190.0 | 1.00 | nan | 0.47 | 171.0 | 0.90 | 20.8 | 15.5 (2) | 91.5 | 100.0 | 41.5 | 0 | 915 |" in md
    assert "| fwd_b1 | ours_strict | error: NoStrictKernelError: no kernel |" in md


def test_model_bench_counts_qwen_image_flops() -> None:
    from mmdit_strict.bench import model
    from mmdit_strict.config.arch import preset

    # one 1024² forward: ≈ 71 TFLOP (the design anchor), and attention grows with the square of the rows
    one = model.forward_flops(preset("qwen-image"), [4096], [128])
    assert 70e12 < one < 72e12
    two = model.forward_flops(preset("qwen-image"), [4096, 4096], [128, 64])
    assert two < 2 * one


def test_report_writer_finish_writes_both_files_and_prints_the_markdown(tmp_path, capsys) -> None:
    """The end of every GEMM bench / sweep / tuning run: the report on disk as it stands, its Markdown on
    stdout, exit status 0; a section recorded after an earlier save is in both."""
    import json

    report = {"env": {}, "rows": [1]}
    run = gemm.ReportWriter(str(tmp_path / "out"), "r", report, lambda r: f"rows {r['rows']} errors {r['errors']}")
    run.save()
    report["rows"].append(2)
    assert run.finish() == 0
    on_disk = json.loads((tmp_path / "out" / "r.json").read_text())
    assert on_disk["rows"] == [1, 2] and on_disk["errors"] == [] and "wall_s" in on_disk
    assert (tmp_path / "out" / "r.md").read_text() == "rows [1, 2] errors []"
    assert capsys.readouterr().out == "rows [1, 2] errors []\n"


def test_gemm_qualification_report_renders_every_section_and_skips_empty_ones() -> None:
    """bench.gemm's own report: each non-empty list a table with its pass count; an empty or missing list no
    section at all."""
    cfg = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, "GROUP_M": 8, "weight_layout": "nk"}
    acc = {"layer": "qkv", "dtype": "bf16", "seqlens": [1, 2], "lora_r": 0, "check": "fwd", "kernel_max_abs": 1e-3, "max_ref": 2.0,
           "torch_max_abs": 2e-3, "kernel_rel_fro": 1e-4, "torch_rel_fro": 2e-4, "pass": True, "torch_pass": True, "pass_2x_torch": False}
    inv = {"layer": "qkv", "dtype": "fp32", "lora_r": 16, "checked": "fwd", "pass": False, "failures": list("abcdef")}
    sp = {"layer": "qkv", "kind": "fwd", "dtype": "bf16", "M": 4224, "ours_ms": 0.1, "cublas_ms": 0.12, "ours_tflops": 600.0,
          "cublas_tflops": 550.0, "speed_vs_cublas": 1.1, "ours_graph_ms": None, "cublas_graph_ms": 0.11}
    lay = {"layer": "qkv", "dtype": "bf16", "M": 4224, "N": 3072, "K": 3072, "variant": "nk", "config": cfg, "timed_by": "graph_ms",
           "graph_ms": 0.1, "cublas_graph_ms": None, "cublas_ms": 0.2, "speed_vs_kn": 1.01, "speed_vs_cublas": 0.9,
           "bytes_equal_kn": True, "regs_spills": [255, 0], "weight_copy_bytes": 2**24}
    report = {"env": {"tf32": False}, "model_layers": [("qkv", 3072, 3072, True, "none", "none", [4224, 8448])],
              "accuracy": [acc, {**acc, "pass": False}], "invariance": [inv], "speed": [sp], "layouts": [lay], "errors": [], "wall_s": 5}
    md = gemm._md(report)
    assert "| qkv | 3072×3072 | True | none | none | 4224, 8448 |" in md
    assert "## Accuracy vs FP64 CPU reference (1/2 pass)" in md and "## Raw-byte batch invariance (0/1 pass)" in md
    assert "| qkv | fp32 | 16 | fwd | FAIL | a, b, c, d |" in md and "| 0.1000 | 0.2000 |" in md and "| 16.0 |" in md
    empty = gemm._md({"env": {}, "model_layers": [], "accuracy": [], "invariance": None, "speed": []})
    assert "## " not in empty.replace("## Errors", "") and empty.endswith("Wall time not recorded.\n")


def test_text_sweep_rows_render_their_byte_comparison() -> None:
    from mmdit_strict.kernels.triton import configs

    base = {"kind": "fwd", "dtype": "bf16", "M": 128, "ms": 0.031, "tflops": 78.0, "graph_ms": 0.031,
            "cublas_graph_ms": 0.008, "ratio_graph": 0.26}
    inc = configs.FWD[(3072, 3072, "bf16")].as_dict()
    rows = [dict(base, layer="qkv (text)", config=inc, incumbent=True, bytes_equal_incumbent=True),
            dict(base, layer="qkv (text)", config=gemm_sweeps.TEXT_SWEEP[0].as_dict(), incumbent=False, bytes_equal_incumbent=True),
            dict(base, layer="qkv (text)", config=gemm_sweeps.TEXT_SWEEP[1].as_dict(), incumbent=False, bytes_equal_incumbent=False)]
    md = gemm_sweeps._md({"env": {}, "sweep": rows})
    assert md.count("(incumbent)") == 1 and md.count("(bytes = incumbent)") == 1 and md.count("(new bytes)") == 1
    assert "64x128x64 w4 s4 g8 nk tma (bytes = incumbent)" in md


def test_text_sweep_candidates_keep_the_k_step_and_classes_have_incumbents() -> None:
    from mmdit_strict.kernels.triton import configs

    for name, n, k, *_ in gemm_sweeps.TEXT_LAYERS:
        assert (n, k, "bf16") in configs.FWD, name  # the incumbent each candidate is compared with
        assert configs.FWD[(n, k, "bf16")].BLOCK_K == 64
    assert all(c.BLOCK_K == 64 and c.weight_layout == "nk" for c in gemm_sweeps.TEXT_SWEEP)
    assert len(set(gemm_sweeps.TEXT_SWEEP)) == len(gemm_sweeps.TEXT_SWEEP)


def test_model_bench_figure_is_drawn_from_a_written_report_without_a_gpu(tmp_path) -> None:
    import json

    import pytest

    from mmdit_strict.bench import model

    timed = {"median_ms": 700.0, "kernel_ms": 650.0}
    report = {"arch_layers": 60, "grid": [64, 64], "environment": {"gpu": "H200", "commit": "abcdef0123"},
              "cases": {"fwd_bwd_lora": {"txt_lens": [128], "diffusers_eager": {"median_ms": 1400.0, "kernel_ms": 700.0},
                                         "ours_strict_graph": timed, "ours_strict": {"error": "OOM"}}}}
    src = tmp_path / "model_bench.json"
    src.write_text(json.dumps(report))
    assert model.main(["--replot", str(src)]) == 0
    png = tmp_path / "model_bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    # nothing timed: no figure, and a clear refusal
    src.write_text(json.dumps({**report, "cases": {"fwd_b1": {"ours_strict": {"error": "OOM"}}}}))
    png.unlink()
    with pytest.raises(SystemExit, match="no timed engine"):
        model.main(["--replot", str(src)])
    assert not png.exists()
    with pytest.raises(SystemExit, match="no report at"):
        model.main(["--replot", str(tmp_path / "missing.json")])

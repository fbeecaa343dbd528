"""The GPU reports' markdown renders every row kind on the CPU (a rendering error at the end of a
device run would lose its results to a traceback)."""

from __future__ import annotations

from mmdit_strict.bench import gemm, gemm_tuning


def test_gemm_report_renders_sweep_winners_and_epilogue_rows() -> None:
    cand = gemm.ROUND5_BIG[3]
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
    md = gemm._md(report)
    assert "128x256x64 w8 s3 g8 kn tma tma-store persistent split2" in md
    assert "0.5500 (0.5600, 1.02) | 254 / 0" in md
    assert "| — | — |" in md  # the row without graph timings or kernel stats
    assert "- gelu_tanh: do_bench 0.5000 ms, graph —" in md
    assert "- cublas addmm: do_bench —, graph 0.4900 ms" in md


def test_tuning_report_renders_errors_and_profiles() -> None:
    ok = {"layer": "qkv", "N": 9216, "K": 3072, "config": gemm_tuning.DW_CANDIDATES[2], "ms": 0.48, "graph_ms": 0.49,
          "cublas_ms": 0.33, "cublas_graph_ms": 0.36, "ratio_graph": 0.73}
    bad = {"layer": "qkv", "config": gemm_tuning.DW_CANDIDATES[5], "error": "OutOfResources: shared memory"}
    report = {"env": {}, "dw": [ok, bad], "host": [
        {"layer": "mod", "M": 8, "what": "gemm_fwd (launches)", "host_us_per_call": 144.8},
        {"layer": "mod", "M": 8, "what": "profile", "profile": "  ncalls  tottime\n"}]}
    md = gemm_tuning._md(report)
    assert "BLOCK_N=128 BLOCK_K=256 BLOCK_M=64" in md and "| 0.4800 | 0.4900 | 0.3600 | 0.73 |" in md
    assert "error: OutOfResources: shared memory" in md
    assert "- mod M=8 gemm_fwd (launches): 144.8 µs/call" in md
    assert "ncalls  tottime" in md

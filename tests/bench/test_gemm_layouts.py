"""The GEMM bench's weight-layout section on the CPU (interpreter, FP32, tiny shapes): both layouts
run through explicit configurations, their outputs are compared in bytes, the report renders, and
the committed configuration tables stay as they are."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from mmdit_strict.bench import gemm as bench  # noqa: E402
from mmdit_strict.kernels.triton import configs as C  # noqa: E402
from mmdit_strict.kernels.triton import gemm as G  # noqa: E402


@pytest.mark.skipif(not G.interpreting(), reason="interpreter dry run; on CUDA the bench runs for real")
def test_layout_case_compares_bytes_and_leaves_configs_alone(monkeypatch) -> None:
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "_bench", lambda fn: (fn(), {"median_ms": 1.0})[1])
    monkeypatch.setattr(bench, "_bench_graph", lambda fn: None)
    before = dict(C.FWD)
    rows = bench.layout_case(G, C, "tiny", 44, 52, True, "none", "gelu_tanh", torch.float32, m=37)
    assert dict(C.FWD) == before
    assert [r["variant"] for r in rows] == ["kn", "nk", "nk+tma"]  # the tiny class loads through pointers
    assert all(r["bytes_equal_kn"] and r["timed_by"] == "ms" and r["speed_vs_kn"] == 1.0 for r in rows)
    assert rows[0]["config"] == C.fwd_config(44, 52, torch.float32).as_dict()
    assert rows[2]["config"]["tma"] and rows[2]["config"]["weight_layout"] == "nk"
    assert [r["weight_copy_bytes"] for r in rows] == [44 * 52 * 4, 0, 0]
    md = bench._md({"env": {"gpu": "cpu"}, "layouts": rows})
    assert "| tiny | float32 | 37 | 44×52 | nk+tma |" in md and md.count("| equal |") == 3


def test_config_tables_are_read_only() -> None:
    key = next(iter(C.FWD))
    with pytest.raises(TypeError):
        C.FWD[key] = C.FWD[key]  # type: ignore[index]
    with pytest.raises(AttributeError):
        C.FWD[key].BLOCK_M = 1  # type: ignore[misc]


def test_report_diff_finds_a_moved_engine_figure() -> None:
    from benchmarks.gemm_report_diff import diff_accuracy

    row = {"layer": "qkv", "dtype": "bfloat16", "seqlens": "(512,)", "lora_r": 0, "check": "forward",
           "torch_max_abs": 0.5, "torch_rel_fro": 1e-3, "kernel_max_abs": 0.25, "kernel_rel_fro": 2e-3}
    old = {"accuracy": [row, dict(row, check="dX")]}
    same = diff_accuracy(old, old)
    assert (same["matched"], same["reference_reproduced"], same["engine_identical"], same["moved"]) == (2, 2, 2, [])
    moved = diff_accuracy(old, {"accuracy": [dict(row, kernel_rel_fro=2.0000001e-3), dict(row, check="dX", torch_rel_fro=1.0)]})
    assert moved["moved"] == [("qkv", "bfloat16", "(512,)", 0, "forward")] and moved["reference_reproduced"] == 1


def test_qualified_gemm_classes_come_from_the_model() -> None:
    """The classes the GEMM qualification measures are the products a strict forward runs, with their
    row counts: checked against the architecture's own dimensions, not a copy of a list."""
    import torch

    from mmdit_strict.bench.gemm_shapes import model_gemm_layers
    from mmdit_strict.config.arch import preset

    a = preset("tiny")
    D, F = a.hidden_size, a.mlp_hidden
    img, txt = 4 * 6, (5, 3)
    layers = {l[0]: l[1:] for l in model_gemm_layers(a, (((4, 6), txt[:1]), ((4, 6), txt)), device="cpu", dtype=torch.float32)}
    both_streams = (txt[0], sum(txt), img, 2 * img)
    assert layers == {
        "temb_1": (D, a.timestep_channels, True, "none", "silu", (1, 2)),
        "temb_2": (D, D, True, "none", "none", (1, 2)),
        "img_in": (D, a.in_channels, True, "none", "none", (img, 2 * img)),
        "txt_in": (D, a.joint_attention_dim, True, "none", "none", (txt[0], sum(txt))),
        "mod": (6 * D, D, True, "silu", "none", (1, 2)),
        "qkv": (D, D, True, "none", "none", both_streams),
        "attn_out": (D, D, True, "none", "none", both_streams),
        "mlp_up": (F, D, True, "none", "gelu_tanh", both_streams),
        "mlp_down": (D, F, True, "none", "none", both_streams),
        "final_mod": (2 * D, D, True, "silu", "none", (1, 2)),
        "proj_out": (a.patch_size**2 * a.out_channels, D, True, "none", "none", (img, 2 * img)),
    }

"""``bench lora_tiles``' section on what the LoRA term costs the big products: its calls run (Triton's interpreter,
FP32, tiny layers) and its table renders."""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.bench import lora_tiles as lt
from mmdit_strict.bench.timing import kernel_stats
from tests.kernels.triton_rows import interp


@interp
def test_lora_term_cases_run_with_and_without_the_adapter() -> None:
    layers = ((16, 24), (24, 16))
    cases = lt.lora_term_cases(4, 11, "cpu", layers=layers, dtype=torch.float32, epilogues={(16, 24): "gelu_tanh"})
    assert [(c["layer"], c["pass"]) for c in cases] == [
        ("16 → 24 (gelu_tanh)", "forward"), ("16 → 24 (gelu_tanh)", "dX"), ("24 → 16", "forward"), ("24 → 16", "dX")]
    for case, want in zip(cases, ((11, 24), (11, 16), (11, 16), (11, 24))):
        plain, lora = case["plain"](), case["lora"]()
        assert plain.shape == lora.shape == want, case["layer"]
        assert torch.equal(case["lora_4parts"](), lora), f"{case['layer']} {case['pass']}: four parts moved bytes"
        assert torch.isfinite(plain).all() and torch.isfinite(lora).all()
        assert not torch.equal(plain, lora), f"{case['layer']} {case['pass']}: the adapter changed nothing"
        if case["pass"] == "forward":  # the interpreter reports no registers: the stats come back empty, not made up
            assert kernel_stats(case["lora"])[1] == [None, None]


def test_lora_term_table_renders() -> None:
    report = {"rank": 64, "rows": 4224, "environment": {"gpu": "H200", "commit": "abc"}, "products": [],
              "lora_term": [{"layer": "3072 → 3072", "pass": "forward", "plain_ms": 0.12, "lora_ms": 0.15, "ratio": 1.25,
                             "lora_4parts_ms": 0.132, "ratio_4parts": 1.1, "4parts_same_bytes": True,
                             "regs_spills": {"plain": [168, 0], "lora": [255, 40], "lora_4parts": [232, 0]}},
                            {"layer": "3072 → 3072", "pass": "dX", "plain_ms": None, "lora_ms": 0.15, "ratio": None}]}
    md = lt.render(report)
    assert "| 3072 → 3072 | forward | 0.1200 | 0.1500 | 1.25 | 0.1320 | 1.10 | yes | 168 / 0 | 255 / 40 | 232 / 0 |" in md
    assert "| 3072 → 3072 | dX | — | 0.1500 | — | — | — | — | — | — | — |" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_the_gpu_bench_refuses_the_cpu() -> None:
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        lt.main([])

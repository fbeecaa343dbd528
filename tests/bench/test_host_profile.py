"""``bench host_profile``: the host-time report of the uncaptured strict step, run for real on the CPU (tiny preset)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmdit_strict.bench import host_profile as hp


@pytest.mark.parametrize("filename,area", [
    ("/opt/venv/lib/python3.12/site-packages/triton/runtime/jit.py", "Triton launcher"),
    ("/work/main/mmdit_strict/kernels/triton/gemm/launch.py", "our kernels' host code"),
    ("/work/main/mmdit_strict/model/strict.py", "our model"),
    ("/x/site-packages/torch/utils/checkpoint.py", "autograd and checkpointing"),
    ("/x/site-packages/torch/autograd/function.py", "autograd and checkpointing"),
    ("/x/site-packages/torch/nn/modules/module.py", "PyTorch Python (other)"),
    ("~", hp.BUILTIN),
    ("/usr/lib/python3.12/contextlib.py", hp.OTHER),
])
def test_functions_are_placed_by_the_file_they_live_in(filename: str, area: str) -> None:
    assert hp.area_of(filename) == area


def test_cli_writes_both_cases_with_shares_that_add_up(tmp_path: Path) -> None:
    from mmdit_strict.cli.main import main

    assert main(["bench", "host_profile", "--out", str(tmp_path), "--device", "cpu"]) == 0
    report = json.loads((tmp_path / "host_profile.json").read_text())
    assert set(report["cases"]) == {"forward", "lora_fwd_bwd"} and report["device"] == "cpu"
    for name, case in report["cases"].items():
        assert case["wall_ms"] > 0 and case["launches"] is None, name
        assert abs(sum(a["share"] for a in case["areas"]) - 1.0) < 1e-9, name
        assert any(a["area"] == "our model" for a in case["areas"]), name
        assert case["functions"] and case["functions"][0]["own_ms"] >= case["functions"][-1]["own_ms"]
    # the LoRA step runs a backward: autograd shows up there and not (or far less) in the no-grad forward
    own = {n: {a["area"]: a["own_ms"] for a in c["areas"]} for n, c in report["cases"].items()}
    assert own["lora_fwd_bwd"]["autograd and checkpointing"] > own["forward"].get("autograd and checkpointing", 0.0)
    assert "## lora_fwd_bwd" in (tmp_path / "host_profile.md").read_text()

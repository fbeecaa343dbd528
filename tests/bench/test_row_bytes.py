"""benchmarks.row_bytes: the cross-commit byte check of the LayerNorm-family kernels (the interpreter at tiny shapes
without a GPU, the product shapes with one)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from benchmarks.row_bytes import compare, main, snapshot


def test_compare_finds_one_flipped_bit_and_missing_tensors():
    a = {"x": torch.arange(6, dtype=torch.float32), "y": torch.ones(2, dtype=torch.bfloat16)}
    b = {"x": a["x"].clone(), "y": a["y"].clone(), "z": torch.zeros(1)}
    b["x"].view(torch.int32)[3] ^= 1  # one ulp: equal under allclose, not in bytes
    rows = dict(compare(a, b))
    assert rows == {"x": "DIFFERENT (1 of 24 bytes)", "y": "equal", "z": "missing before"}
    neg = {"x": torch.tensor([0.0]), "y": a["y"]}
    assert dict(compare(neg, {"x": torch.tensor([-0.0]), "y": a["y"]}))["x"].startswith("DIFFERENT")  # -0.0 == 0.0


def test_snapshot_covers_both_operators_and_compares_equal_to_itself(tmp_path):
    snap = snapshot("cuda" if torch.cuda.is_available() else "cpu")  # the interpreter without a GPU (conftest)
    assert {k.split(".", 1)[1] for k in snap} == {"ln_y", "ln_mean", "ln_rstd", "ln_dx", "ln_dshift", "ln_dscale",
                                                  "gate_out", "gate_dy", "gate_dgate"}
    assert all(torch.isfinite(t.float()).all() for t in snap.values())
    out = tmp_path / "a.safetensors"
    assert main(["snap", str(out)]) == 0
    again = load_file(str(out))
    assert all(v == "equal" for _, v in compare(snap, again))  # the kernels are deterministic run to run
    assert main(["compare", str(out), str(out), "--md", str(tmp_path / "t.md")]) == 0
    again[next(iter(again))].view(torch.uint8)[0] ^= 1
    changed = tmp_path / "b.safetensors"
    save_file(again, str(changed))
    assert main(["compare", str(out), str(changed)]) == 1

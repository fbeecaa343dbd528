"""``benchmarks/lora_parts_bytes``: which forced split disagrees with the configured launch, and the two-run compare."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import lora_parts_bytes as lpb


def _digests(**moved: str) -> dict[str, str]:
    out = {}
    for split in ("configured", 1, 2, 4):
        for name in ("y", "dX"):
            key = f"bfloat16 3072->3072 image M=77 split={split} {name}"
            out[key] = moved.get(f"{split}{name}", f"h-{name}")
    return out


def test_split_mismatches_name_the_split_and_output_that_moved() -> None:
    assert lpb.split_mismatches(_digests()) == []
    assert lpb.split_mismatches(_digests(**{"4dX": "other"})) == ["bfloat16 3072->3072 image M=77 split=4 dX"]


def test_compare_exits_nonzero_when_an_output_moved(tmp_path: Path, capsys) -> None:
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps({"digests": _digests()}))
    b.write_text(json.dumps({"digests": _digests()}))
    c.write_text(json.dumps({"digests": _digests(**{"2y": "other"})}))
    assert lpb.main(["--compare", str(a), str(b)]) == 0
    assert "8 outputs in both; 0 moved" in capsys.readouterr().out
    assert lpb.main(["--compare", str(a), str(c)]) == 1
    assert "moved: bfloat16 3072->3072 image M=77 split=2 y" in capsys.readouterr().out

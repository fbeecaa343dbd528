"""`mmdit-strict bench load` on the CPU at tiny size: it writes its random sharded checkpoint, times both
loaders in child processes and writes a report whose figures and verdicts are filled in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmdit_strict.bench import load as load_bench
from mmdit_strict.cli.main import main as cli_main


@pytest.mark.slow
def test_load_bench_writes_a_filled_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert load_bench.main(["--out", str(out), "--device", "cpu", "--preset", "tiny", "--shards", "3", "--repeats", "1",
                            "--cache", str(tmp_path / "cache")]) == 0
    report = json.loads((out / "load_bench.json").read_text())
    ck, s = report["checkpoint"], report["summary"]
    assert ck["written_by_bench"] and ck["shards"] == 3 and ck["warm_read_bytes"] >= ck["bytes"] > 0
    assert [(r["repeat"], r["engine"]) for r in report["runs"]] == [(0, "diffusers"), (0, "ours")]
    assert all(r["seconds"] > 0 and r["param_device"] == "cpu" and r["param_dtypes"] == ["torch.bfloat16"] for r in report["runs"])
    assert s["same_bytes_every_load"] and s["equals_written_model"] and s["bar"]["bytes"]
    assert s["ratio_ours_over_diffusers"] == pytest.approx(s["engines"]["ours"]["median_s"] / s["engines"]["diffusers"]["median_s"])
    env = report["environment"]
    assert env["gpu"] is None and env["diffusers"] and env["torch"] and env["commit"] and report["errors"] == []
    md = (out / "load_bench.md").read_text()
    assert md.splitlines()[2].startswith("CPU ") and f"diffusers {env['diffusers']}" in md
    assert f"ours / diffusers (medians): {s['ratio_ours_over_diffusers']:.2f}×" in md
    digest = report["runs"][0]["state_sha256"][:16]
    assert md.count(digest) == 2 and "| diffusers | 1 |" in md and "| ours | 1 |" in md


def test_cli_passes_the_load_options_and_refuses_them_elsewhere(tmp_path: Path, monkeypatch, capsys) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr(load_bench, "main", lambda argv: seen.append(list(argv)) or 0)
    assert cli_main(["bench", "load", "--out", str(tmp_path), "--checkpoint", "ck", "--device", "cpu", "--repeats", "2"]) == 0
    assert seen == [["--out", str(tmp_path), "--checkpoint", "ck", "--device", "cpu", "--repeats", "2"]]
    assert cli_main(["bench", "cpu_strict", "--out", str(tmp_path), "--repeats", "2"]) == 2
    assert "belong to `bench load`" in capsys.readouterr().err

"""A parallel main job under torchrun (gloo, CPU): the rollout with sequence × CFG parallelism and the
recompute with tensor × CFG parallelism give one process's bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.test_torchrun import SMALL, cli, ok, plain, sha, torchrun


def test_parallel_run_is_byte_identical_to_one_process(tmp_path: Path) -> None:
    par = tmp_path / "par"
    ok(torchrun(4, "run", f"output_dir={par}", *SMALL, "rollout.parallel.sp=2", "rollout.parallel.cfg=2",
                "recompute.parallel.tp=2", "recompute.parallel.cfg=2", timeout=600))
    report = json.loads((par / "report" / "report.json").read_text())
    assert report["byte_identical"] is True
    man = json.loads((par / "rollout" / "manifest.json").read_text())
    assert man["side"]["parallel"] == {"tp": 1, "sp": 2, "cfg": 2, "attention": "ulysses"}
    rec = json.loads((par / "recompute" / "manifest.json").read_text())
    assert rec["side"]["parallel"] == {"tp": 2, "sp": 1, "cfg": 2, "attention": "ulysses"}
    assert set(man["side"]["owner_rank"]) == {0}  # one model group of 4 ranks: its first rank owns every row
    one = tmp_path / "one"
    ok(plain("rollout", f"output_dir={one}", *SMALL))
    assert sha(par / "rollout" / "tensors.safetensors") == sha(one / "rollout" / "tensors.safetensors")


@pytest.mark.parametrize("override, message", [("rollout.parallel.sp=2", "launch with torchrun"),
                                               ("rollout.parallel.tp=2", "launch with torchrun"),
                                               ("rollout.parallel.cfg=3", "cfg must be 1 or 2")])
def test_layouts_that_cannot_run_are_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture, override: str,
                                                     message: str) -> None:
    assert cli("rollout", f"output_dir={tmp_path / 'x'}", *SMALL, override) != 0
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.extended  # the row owner / adapter / run parts are covered by faster tests
def test_a_drift_names_the_rank_that_computed_the_row(tmp_path: Path) -> None:
    """The rollout runs sp 2; a fault planted in one image row of the recompute (one rank per sample) drifts, and
    the first-drift line names the sequence rank of the rollout's group that computed that row."""
    out = tmp_path / "fault"
    proc = torchrun(2, "run", f"output_dir={out}", *SMALL, "rollout.parallel.sp=2",
                    "recompute.inject_fault=block0.img.mlp_down_gemm#40@1", timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = (out / "report" / "report.md").read_text()
    assert "row 40" in line and "rollout rank 1 (sp 1 of 2)" in line  # 128² = 8×8 rows: 40 is in shard 1, line[:1500]


@pytest.mark.slow
def test_the_layout_check_command_writes_a_passing_report(tmp_path: Path) -> None:
    """``python -m mmdit_strict.trajectories.layout_check`` (the H200 evidence tool) on 2 CPU ranks: every layout
    that fits 2 ranks and the tiny model's 2 heads is checked on both ranks and byte-equal to one rank."""
    import subprocess
    import sys

    from tests.distributed.test_torchrun import ROOT, _env, ok

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "mmdit_strict.trajectories.layout_check", "--layouts", "sp2,tp2,cfg2,sp2ag,tp2xsp2", "--lora-rank", "2",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    ok(proc)
    report = json.loads((tmp_path / "parallel_check.json").read_text())
    assert report["pass"] is True and report["world"] == 2
    rows = report["rows"]
    assert sorted({r["layout"] for r in rows}) == ["cfg2", "sp2", "sp2ag", "tp2"]  # tp2xsp2 needs 4 ranks: left out
    assert all(r["rank"] in (0, 1) and r["v"] and r["group_fold"] and r["exchanges"] > 0 for r in rows)
    assert "all byte-equal" in (tmp_path / "parallel_check.md").read_text()

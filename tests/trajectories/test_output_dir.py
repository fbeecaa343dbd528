"""Output folders are guarded: foreign folders and empty names are refused, a folder in use is locked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mmdit_strict.cli.main import main
from mmdit_strict.trajectories.outdir import LOCK, MARKER, OutputDirError, claim_output_dir

SMALL = ["sampler.num_steps=2", "prompts.num_prompts=2", "wandb.mode=disabled", "progress=false"]
REPO = Path(__file__).resolve().parents[2]


def test_folder_with_foreign_files_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    configs = shutil.copytree(REPO / "configs", tmp_path / "configs")
    before = (configs / "config.yaml").read_text()
    assert main(["run", "--quiet", f"output_dir={configs}", *SMALL]) == 2
    err = capsys.readouterr().err
    assert "holds files a run did not write" in err and "config.yaml" in err
    assert (configs / "config.yaml").read_text() == before
    assert not (configs / "rollout").exists()


def test_empty_output_dir_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--quiet", "output_dir=", *SMALL]) == 2
    assert "output_dir" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_run_folder_gets_a_marker_and_is_reusable(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["run", "--quiet", f"output_dir={out}", *SMALL]) == 0
    assert json.loads((out / MARKER).read_text())["written_by"] == "mmdit-strict"
    assert not (out / LOCK).exists() or not _locked(out)
    assert main(["run", "--quiet", f"output_dir={out}", *SMALL]) == 0
    # an empty existing folder is fine too
    (tmp_path / "empty").mkdir()
    assert main(["rollout", "--quiet", f"output_dir={tmp_path / 'empty'}", *SMALL]) == 0


def _locked(out: Path) -> bool:
    try:
        with claim_output_dir(out):
            return False
    except OutputDirError:
        return True


def test_second_run_into_a_folder_in_use_fails_at_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    with claim_output_dir(out):
        assert main(["run", "--quiet", f"output_dir={out}", *SMALL]) == 2
        err = capsys.readouterr().err
        assert "in use" in err and str(os.getpid()) in err
        assert not (out / "rollout").exists()
    # released: a run goes through
    assert main(["run", "--quiet", f"output_dir={out}", *SMALL]) == 0


def test_lock_held_by_another_process_blocks_and_dies_with_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom mmdit_strict.trajectories.outdir import claim_output_dir\n"
         "with claim_output_dir(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(60)\n", str(out)],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputDirError, match=f"in use by process {holder.pid}"):
            with claim_output_dir(out):
                pass
    finally:
        holder.kill()
        holder.wait()
    # the killed holder left its lock file behind; it does not block
    assert (out / LOCK).exists()
    with claim_output_dir(out):
        pass


def test_output_dir_that_is_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "afile"
    f.write_text("mine")
    assert main(["run", "--quiet", f"output_dir={f}", *SMALL]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert f.read_text() == "mine"

"""What a hostile user tries on a fresh clone: folders that belong to another command, stale results
after a code change, swapped artifacts, sweeps and wandb that fail late, GPU commands on a CPU,
commits read from the wrong repository. Each test names the row of the trust table it covers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mmdit_strict.cli.main import main
from mmdit_strict.trajectories.outdir import MARKER

SMALL = ["sampler.num_steps=2", "prompts.num_prompts=2", "wandb.mode=disabled", "progress=false", "--quiet"]
REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "mmdit_strict"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished main-job folder (2 steps × 2 samples), shared read-only by the tests that copy it."""
    out = tmp_path_factory.mktemp("trust") / "run"
    assert main(["run", f"output_dir={out}", *SMALL]) == 0
    return out


def test_report_on_a_foreign_folder_plants_no_marker(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Row 2: `report` on a folder that is not a run is refused and leaves it as it was; a later `run`
    into it is still refused, so the user's config.yaml survives."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my: settings\n")
    assert main(["report", str(mine)]) == 2
    assert "not a folder made by mmdit-strict" in capsys.readouterr().err
    assert sorted(p.name for p in mine.iterdir()) == ["config.yaml"]
    assert main(["run", f"output_dir={mine}", *SMALL]) == 2
    assert "holds files a run did not write" in capsys.readouterr().err
    assert (mine / "config.yaml").read_text() == "my: settings\n"


def test_run_refuses_a_training_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Row 3: `run output_dir=<a training run's folder>` is refused and the training config is kept."""
    from mmdit_strict.trajectories.outdir import claim_output_dir

    train_dir = tmp_path / "train"
    with claim_output_dir(train_dir, kind="train"):  # what `train` claims before it writes
        (train_dir / "config.yaml").write_text("train: mine\n")
    assert json.loads((train_dir / MARKER).read_text())["kind"] == "train"
    for command in ("run", "rollout", "recompute"):
        assert main([command, f"output_dir={train_dir}", *SMALL]) == 2
        assert "belongs to a train command" in capsys.readouterr().err
    assert main(["report", str(train_dir)]) == 2
    assert (train_dir / "config.yaml").read_text() == "train: mine\n"
    assert not (train_dir / "rollout").exists()


def test_train_refuses_a_run_folder(finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Row 3, the other way: `train` into a main-job folder is refused before any work."""
    run = shutil.copytree(finished_run, tmp_path / "run")
    before = (run / "config.yaml").read_text()
    assert main(["train", "experiment=grpo_tiny", f"output_dir={run}", "wandb.mode=disabled", "--quiet"]) == 2
    assert "belongs to a run command" in capsys.readouterr().err
    assert (run / "config.yaml").read_text() == before and not (run / "checkpoints").exists()


def _copy_package(dest: Path) -> Path:
    shutil.copytree(PACKAGE, dest / "mmdit_strict", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _cli(pythonpath: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(pythonpath), os.environ.get("PYTHONPATH")])),
           "MMDIT_COMMIT": ""}
    return subprocess.run([sys.executable, "-m", "mmdit_strict", *argv], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


@pytest.mark.slow
def test_a_code_change_reruns_the_stages(tmp_path: Path) -> None:
    """Row 4: after the code changes (here: an edited CPU kernel module in a copy of the package), `run`
    into the earlier folder re-runs both stages and says so at WARNING; unchanged code reuses them."""
    code = _copy_package(tmp_path / "code")
    out = tmp_path / "run"
    args = ("run", f"output_dir={out}", f"--config-dir={REPO / 'configs'}", *SMALL)
    first = _cli(code, *args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    key = json.loads((out / "rollout" / "manifest.json").read_text())["stage_key"]
    again = _cli(code, *args, cwd=tmp_path)
    assert again.returncode == 0 and "re-running" not in again.stderr
    kernel = code / "mmdit_strict" / "kernels" / "cpu" / "gemm.py"
    kernel.write_text(kernel.read_text() + "\n# an edit that changes no arithmetic still changes the code\n")
    edited = _cli(code, *args, cwd=tmp_path)
    assert edited.returncode == 0, edited.stderr
    assert "WARNING" in edited.stderr
    for stage in ("rollout", "recompute"):
        assert f"re-running {stage}" in edited.stderr and "code changed" in edited.stderr
    new_key = json.loads((out / "rollout" / "manifest.json").read_text())["stage_key"]
    assert new_key["code"] != key["code"] and {k: v for k, v in new_key.items() if k != "code"} == \
        {k: v for k, v in key.items() if k != "code"}


def test_report_refuses_a_rollout_where_the_recompute_belongs(finished_run: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    """Row 5: a run whose recompute/ is a copy of its rollout/ is refused, naming the kinds."""
    run = shutil.copytree(finished_run, tmp_path / "run")
    shutil.rmtree(run / "recompute")
    shutil.copytree(run / "rollout", run / "recompute")
    assert main(["report", str(run)]) == 2
    assert "is a rollout artifact where a recompute artifact belongs" in capsys.readouterr().err
    # and a recompute given to `recompute --rollout` as the rollout it should replay
    assert main(["recompute", f"output_dir={tmp_path / 'again'}", f"--rollout={finished_run / 'recompute'}", *SMALL]) == 2
    assert "is a recompute artifact where a rollout artifact belongs" in capsys.readouterr().err


def test_sweep_is_validated_before_any_job_runs(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 6: `run -m runtime=strict,bogus` fails before job 0 runs; a sweep whose job fails writes
    multirun.yaml anyway, with every job's status."""
    import mmdit_strict.trajectories.pipeline as pipeline

    ran = []
    real = pipeline.run_all
    monkeypatch.setattr(pipeline, "run_all", lambda cfg, progress=True: ran.append(cfg.output_dir) or real(cfg, progress))
    out = tmp_path / "sweep"
    assert main(["run", "-m", "runtime=strict,bogus", f"output_dir={out}", *SMALL]) == 2
    err = capsys.readouterr().err
    assert "multirun job 1 (runtime=bogus" in err and "unknown option 'bogus'" in err and "no job was run" in err
    assert ran == [] and not out.exists()

    def crash_second(cfg, progress=True):
        if cfg.sampler.num_steps == 3:
            raise RuntimeError("died in job 1")
        return real(cfg, progress)

    monkeypatch.setattr(pipeline, "run_all", crash_second)
    assert main(["run", "-m", "sampler.num_steps=2,3,4", f"output_dir={out}", *SMALL[1:]]) == 2
    jobs = yaml.safe_load((out / "multirun.yaml").read_text())["jobs"]
    assert [(j["status"], j["exit_code"]) for j in jobs] == [("done", 0), ("error", 2), ("not run", None)]
    assert "died in job 1" in jobs[1]["error"]


def test_wandb_online_without_a_login_fails_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture) -> None:
    """Row 7: `run wandb.mode=online` without a login exits 2 at once (nothing written), for `train` too."""
    pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no wandb settings
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # no terminal to ask on
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    out = tmp_path / "run"
    assert main(["run", f"output_dir={out}", *[a for a in SMALL if not a.startswith("wandb")], "wandb.mode=online"]) == 2
    assert "wandb.mode=online needs a wandb login" in capsys.readouterr().err
    assert not out.exists()
    assert main(["train", "experiment=grpo_tiny", f"output_dir={tmp_path / 'train'}", "wandb.mode=online", "--quiet"]) == 2
    assert "wandb.mode=online needs a wandb login" in capsys.readouterr().err
    assert not (tmp_path / "train").exists()


def test_a_wandb_failure_after_the_work_keeps_the_result_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    """Row 7: when wandb fails after the job, the result line is printed before the error."""
    pytest.importorskip("wandb")
    import mmdit_strict.cli.wandb_log as wandb_log

    def offline_then_fail(cfg, result):
        raise OSError("wandb: network unreachable")

    monkeypatch.setattr(wandb_log, "log_run", offline_then_fail)
    assert main(["run", f"output_dir={tmp_path / 'run'}", *[a for a in SMALL if not a.startswith("wandb")],
                 "wandb.mode=offline"]) == 2
    captured = capsys.readouterr()
    assert "byte-identical: 2 steps × 2 samples" in captured.out and "report:" in captured.out
    assert "network unreachable" in captured.err


@pytest.mark.parametrize("override, key", [("sampler.num_steps=4", "sampler.num_steps=4 (rollout: 2)"),
                                           ("sampler.cfg_scale=2.0", "sampler.cfg_scale=2.0 (rollout: 4.0)"),
                                           ("seed=7", "seed=7 (rollout: 0)")])
def test_recompute_refuses_settings_that_differ_from_the_rollout(finished_run: Path, tmp_path: Path, override: str,
                                                                 key: str, capsys: pytest.CaptureFixture) -> None:
    """Row 12: `recompute --rollout R sampler.num_steps=4` (or another CFG scale, seed) is refused up front,
    naming the key; nothing is recomputed."""
    out = tmp_path / "re"
    assert main(["recompute", f"--rollout={finished_run / 'rollout'}", f"output_dir={out}", *SMALL, override]) == 2
    err = capsys.readouterr().err
    assert "differ from the rollout it replays" in err and key in err
    assert not (out / "recompute").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
@pytest.mark.parametrize("argv", [["bench", "gemm"], ["bench", "model"], ["bench", "norms"], ["qualify"]])
def test_gpu_commands_on_a_cpu_exit_2_with_one_line(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Row 13: `bench gemm` / `bench model` / `qualify` without a GPU exit 2 (1 means drift) with one line."""
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA GPU" in err
    assert not (tmp_path / "out").exists()


def test_commit_is_unknown_for_a_copy_inside_another_repository(tmp_path: Path) -> None:
    """Row 16: an unpacked copy of the package inside another git repository does not report that
    repository's HEAD as the commit it ran; a repository that tracks the package does."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    other = tmp_path / "other"
    other.mkdir()
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=other, check=True)
    (other / "theirs.txt").write_text("theirs\n")
    subprocess.run([*git, "add", "theirs.txt"], cwd=other, check=True)
    subprocess.run([*git, "commit", "-qm", "theirs"], cwd=other, check=True)
    theirs = subprocess.run(["git", "rev-parse", "HEAD"], cwd=other, capture_output=True, text=True).stdout.strip()
    _copy_package(other / "vendor")
    probe = "from mmdit_strict.environment import commit; print(commit())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(other / "vendor"), os.environ.get("PYTHONPATH")])),
           "MMDIT_COMMIT": ""}
    untracked = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert untracked.returncode == 0, untracked.stderr
    assert untracked.stdout.startswith("unknown") and theirs not in untracked.stdout
    subprocess.run([*git, "add", "vendor"], cwd=other, check=True)
    subprocess.run([*git, "commit", "-qm", "vendor the package"], cwd=other, check=True)
    ours = subprocess.run(["git", "rev-parse", "HEAD"], cwd=other, capture_output=True, text=True).stdout.strip()
    tracked = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert tracked.stdout.strip() == ours


def test_wandb_online_finds_a_configured_login(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 7: the up-front check accepts what `wandb login` writes (a netrc entry for the wandb host) and
    WANDB_API_KEY, and refuses neither."""
    from mmdit_strict.cli.wandb_log import require_wandb

    pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "stdin", open(os.devnull))
    rc = tmp_path / "netrc"
    monkeypatch.setenv("NETRC", str(rc))
    with pytest.raises(ValueError, match="needs a wandb login"):
        require_wandb("online")
    require_wandb("offline")  # offline logging needs no login
    rc.write_text("machine api.wandb.ai\n  login user\n  password " + "0" * 40 + "\n")
    rc.chmod(0o600)
    require_wandb("online")
    rc.unlink()
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    require_wandb("online")


def test_help_says_where_a_plus_override_adds_its_key() -> None:
    """Row 15: `--help` said `+key=v` adds under `extra`; it adds the key where it names it, which must be a
    free-form section of the command's schema (a new root key is refused, naming the valid ones)."""
    from mmdit_strict.cli.main import build_parser
    from mmdit_strict.config.compose import ConfigError, compose

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = " ".join(sub.choices["run"].format_help().split())
    assert "adds a key that does not exist yet to a free-form section" in text and "+extra.note=v" in text
    assert compose(["+extra.note=2"]).extra.note == 2
    with pytest.raises(ConfigError, match="valid keys for run"):
        compose(["+note=1"])

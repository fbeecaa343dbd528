"""A killed rollout or recompute resumes after its last finished step and gives the same bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

import mmdit_strict.trajectories.recompute as recompute_mod
import mmdit_strict.trajectories.rollout as rollout_mod
from mmdit_strict.config.compose import compose
from mmdit_strict.trajectories import compare, partial, run_recompute, run_rollout

BASE = ["sampler.num_steps=4", "prompts.num_prompts=3", "wandb.mode=disabled"]


class Killed(RuntimeError):
    pass


def _kill_at(monkeypatch: pytest.MonkeyPatch, module, at_step: int) -> None:
    real = module.step_latents

    def step_latents(cfg, v, x, sigmas, step, ids, prev_sample=None):
        if step == at_step:
            raise Killed(f"killed at step {step}")
        return real(cfg, v, x, sigmas, step, ids, prev_sample=prev_sample)

    monkeypatch.setattr(module, "step_latents", step_latents)


def _hashes(traj):
    return [(s["v"], s["x"], s["logp"]) for s in traj.manifest["steps"]]


def test_killed_rollout_resumes_with_identical_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = compose([f"output_dir={tmp_path}", *BASE])
    whole = run_rollout(cfg, tmp_path / "whole", progress=False)

    _kill_at(monkeypatch, rollout_mod, 2)
    with pytest.raises(Killed):
        run_rollout(cfg, tmp_path / "killed", progress=False)
    assert (tmp_path / "killed.partial" / "state.json").exists() and not (tmp_path / "killed").exists()
    monkeypatch.undo()

    resumed = run_rollout(cfg, tmp_path / "killed", progress=False)
    assert resumed.manifest["side"]["resumed_after_step"] == 2
    assert _hashes(resumed) == _hashes(whole)
    assert compare(whole, resumed).byte_identical
    assert not (tmp_path / "killed.partial").exists(), "the checkpoint is dropped once the artifact is written"


def test_killed_recompute_resumes_with_identical_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = compose([f"output_dir={tmp_path}", *BASE])
    rollout = run_rollout(cfg, tmp_path / "rollout", progress=False)
    whole = run_recompute(cfg, rollout, tmp_path / "whole", progress=False)

    _kill_at(monkeypatch, recompute_mod, 3)
    with pytest.raises(Killed):
        run_recompute(cfg, rollout, tmp_path / "killed", progress=False)
    monkeypatch.undo()
    resumed = run_recompute(cfg, rollout, tmp_path / "killed", progress=False)
    assert resumed.manifest["side"]["resumed_after_step"] == 3
    assert _hashes(resumed) == _hashes(whole)
    grads = lambda t: [g["sample_order_sha256"] for g in t.manifest["side"]["lora_grads_per_step"]]  # noqa: E731
    assert grads(resumed) == grads(whole)
    assert resumed.manifest["trace"]["calls"] == whole.manifest["trace"]["calls"]


def test_checkpoint_of_other_settings_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = compose([f"output_dir={tmp_path}", *BASE])
    _kill_at(monkeypatch, rollout_mod, 2)
    with pytest.raises(Killed):
        run_rollout(cfg, tmp_path / "r", progress=False)
    monkeypatch.undo()
    other = compose([f"output_dir={tmp_path}", *BASE, "sampler.cfg_scale=3.0"])
    traj = run_rollout(other, tmp_path / "r", progress=False)
    assert traj.manifest["side"]["resumed_after_step"] is None
    # a corrupt checkpoint is dropped, not trusted
    _kill_at(monkeypatch, rollout_mod, 2)
    with pytest.raises(Killed):
        run_rollout(cfg, tmp_path / "c", progress=False)
    monkeypatch.undo()
    step_file = tmp_path / "c.partial" / "step_00001.safetensors"
    step_file.write_bytes(step_file.read_bytes()[:40])
    traj = run_rollout(cfg, tmp_path / "c", progress=False)
    assert traj.manifest["side"]["resumed_after_step"] is None
    assert partial.partial_dir(tmp_path / "c").exists() is False

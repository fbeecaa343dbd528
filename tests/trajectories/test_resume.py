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


def _run_killed(monkeypatch: pytest.MonkeyPatch, module, at_step: int, run, *args) -> None:
    """``run(*args, progress=False)`` with ``module.step_latents`` killed at step ``at_step``: the run must
    raise :class:`Killed`, leaving its checkpoint behind; the patch is undone afterwards."""
    real = module.step_latents

    def step_latents(sampler, seed, v, x, sigmas, step, ids, prev_sample=None):
        if step == at_step:
            raise Killed(f"killed at step {step}")
        return real(sampler, seed, v, x, sigmas, step, ids, prev_sample=prev_sample)

    monkeypatch.setattr(module, "step_latents", step_latents)
    with pytest.raises(Killed):
        run(*args, progress=False)
    monkeypatch.undo()


def _hashes(traj):
    return [(s["v"], s["x"], s["logp"]) for s in traj.manifest["steps"]]


def test_killed_rollout_resumes_with_identical_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = compose([f"output_dir={tmp_path}", *BASE])
    whole = run_rollout(cfg, tmp_path / "whole", progress=False)

    _run_killed(monkeypatch, rollout_mod, 2, run_rollout, cfg, tmp_path / "killed")
    assert (tmp_path / "killed.partial" / "state.json").exists() and not (tmp_path / "killed").exists()

    resumed = run_rollout(cfg, tmp_path / "killed", progress=False)
    assert resumed.manifest["side"]["resumed_after_step"] == 2
    assert _hashes(resumed) == _hashes(whole)
    assert compare(whole, resumed).byte_identical
    assert not (tmp_path / "killed.partial").exists(), "the checkpoint is dropped once the artifact is written"


def test_killed_recompute_resumes_with_identical_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = compose([f"output_dir={tmp_path}", *BASE])
    rollout = run_rollout(cfg, tmp_path / "rollout", progress=False)
    whole = run_recompute(cfg, rollout, tmp_path / "whole", progress=False)

    _run_killed(monkeypatch, recompute_mod, 3, run_recompute, cfg, rollout, tmp_path / "killed")
    resumed = run_recompute(cfg, rollout, tmp_path / "killed", progress=False)
    assert resumed.manifest["side"]["resumed_after_step"] == 3
    assert _hashes(resumed) == _hashes(whole)
    grads = lambda t: [g["sample_order_sha256"] for g in t.manifest["side"]["lora_grads_per_step"]]
    assert grads(resumed) == grads(whole)
    assert resumed.manifest["trace"]["calls"] == whole.manifest["trace"]["calls"]


def test_checkpoint_of_other_settings_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = compose([f"output_dir={tmp_path}", *BASE])
    _run_killed(monkeypatch, rollout_mod, 2, run_rollout, cfg, tmp_path / "r")
    other = compose([f"output_dir={tmp_path}", *BASE, "sampler.cfg_scale=3.0"])
    traj = run_rollout(other, tmp_path / "r", progress=False)
    assert traj.manifest["side"]["resumed_after_step"] is None
    # a corrupt checkpoint is dropped, not trusted
    _run_killed(monkeypatch, rollout_mod, 2, run_rollout, cfg, tmp_path / "c")
    step_file = tmp_path / "c.partial" / "step_00001.safetensors"
    step_file.write_bytes(step_file.read_bytes()[:40])
    traj = run_rollout(cfg, tmp_path / "c", progress=False)
    assert traj.manifest["side"]["resumed_after_step"] == 1, "step 0 is intact; step 1 is recomputed from it"
    assert partial.partial_dir(tmp_path / "c").exists() is False
    assert _hashes(traj) == _hashes(run_rollout(cfg, tmp_path / "whole", progress=False))


def _flip_data_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x04  # inside the tensor data, not the header: the file still parses
    path.write_bytes(bytes(data))


def test_flipped_bit_in_a_step_checkpoint_is_recomputed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = compose([f"output_dir={tmp_path}", *BASE])
    rollout = run_rollout(cfg, tmp_path / "rollout", progress=False)
    whole = run_recompute(cfg, rollout, tmp_path / "whole", progress=False)
    _run_killed(monkeypatch, recompute_mod, 3, run_recompute, cfg, rollout, tmp_path / "killed")
    _flip_data_bit(tmp_path / "killed.partial" / "step_00001.safetensors")
    resumed = run_recompute(cfg, rollout, tmp_path / "killed", progress=False)
    assert resumed.manifest["side"]["resumed_after_step"] == 1
    assert _hashes(resumed) == _hashes(whole)
    assert compare(rollout, resumed).byte_identical


def test_swapped_step_checkpoints_are_recomputed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = compose([f"output_dir={tmp_path}", *BASE])
    whole = run_rollout(cfg, tmp_path / "whole", progress=False)
    _run_killed(monkeypatch, rollout_mod, 3, run_rollout, cfg, tmp_path / "killed")
    d = tmp_path / "killed.partial"
    one, two = d / "step_00001.safetensors", d / "step_00002.safetensors"
    a, b = one.read_bytes(), two.read_bytes()
    one.write_bytes(b)
    two.write_bytes(a)
    resumed = run_rollout(cfg, tmp_path / "killed", progress=False)
    assert resumed.manifest["side"]["resumed_after_step"] == 1
    assert _hashes(resumed) == _hashes(whole)


def _checkpoint_meta_bytes(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in d.iterdir() if not p.name.endswith(".safetensors")}


def test_step_checkpoint_metadata_grows_linearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """state.json is not rewritten with every prior step's data: per-step records are appended once."""
    cfg = compose([f"output_dir={tmp_path}", *BASE, "sampler.num_steps=5"])
    rollout = run_rollout(cfg, tmp_path / "rollout", progress=False)
    sizes = {}
    for k in (1, 4):
        _run_killed(monkeypatch, recompute_mod, k, run_recompute, cfg, rollout, tmp_path / f"k{k}")
        sizes[k] = _checkpoint_meta_bytes(tmp_path / f"k{k}.partial")
    assert sizes[1]["state.json"] == sizes[4]["state.json"], sizes
    assert sum(sizes[4].values()) <= 4 * sum(sizes[1].values()), sizes

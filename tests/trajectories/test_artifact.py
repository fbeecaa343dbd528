"""Artifacts are written atomically and refused when corrupt, truncated or from another version."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mmdit_strict.config.compose import compose
from mmdit_strict.trajectories import TrajectoryError, compare, read, run_rollout


@pytest.fixture(scope="module")
def rollout_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("art")
    cfg = compose([f"output_dir={out}", "sampler.num_steps=2", "prompts.num_prompts=2", "lora.rank=0"])
    run_rollout(cfg, out / "rollout", progress=False)
    return out / "rollout"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_roundtrip_verifies(rollout_dir: Path) -> None:
    traj = read(rollout_dir)
    assert traj.num_steps == 2 and traj.sample_ids == [0, 1]
    assert traj.tensors["x"].shape[:2] == (3, 2)
    assert not list(rollout_dir.parent.glob(".rollout.*")), "temporary folders must not survive a write"
    assert compare(traj, read(rollout_dir)).byte_identical


def test_flipped_byte_is_refused(rollout_dir: Path, tmp_path: Path) -> None:
    bad = _copy(rollout_dir, tmp_path / "flip")
    data = bytearray((bad / "tensors.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x01
    (bad / "tensors.safetensors").write_bytes(bytes(data))
    with pytest.raises(TrajectoryError, match="corrupt or truncated"):
        read(bad)


def test_truncated_is_refused(rollout_dir: Path, tmp_path: Path) -> None:
    bad = _copy(rollout_dir, tmp_path / "trunc")
    data = (bad / "tensors.safetensors").read_bytes()
    (bad / "tensors.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(TrajectoryError, match="corrupt or truncated"):
        read(bad)
    (bad / "manifest.json").write_text((bad / "manifest.json").read_text()[:100])
    with pytest.raises(TrajectoryError, match="invalid JSON"):
        read(bad)


def test_version_skew_is_refused(rollout_dir: Path, tmp_path: Path) -> None:
    bad = _copy(rollout_dir, tmp_path / "ver")
    m = json.loads((bad / "manifest.json").read_text())
    m["format_version"] = 99
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TrajectoryError, match="format version 99"):
        read(bad)


def test_hash_mismatch_is_refused(rollout_dir: Path, tmp_path: Path) -> None:
    bad = _copy(rollout_dir, tmp_path / "hash")
    m = json.loads((bad / "manifest.json").read_text())
    m["steps"][1]["v"][0] = "0" * 64
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TrajectoryError, match="step 1 sample 0: stored v does not match its hash"):
        read(bad)


def test_missing_files_are_refused(rollout_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TrajectoryError, match="no manifest.json"):
        read(tmp_path)
    bad = _copy(rollout_dir, tmp_path / "missing")
    (bad / "tensors.safetensors").unlink()
    with pytest.raises(TrajectoryError, match="missing tensors.safetensors"):
        read(bad)


def test_different_inputs_are_not_comparable(rollout_dir: Path, tmp_path: Path) -> None:
    cfg = compose([f"output_dir={tmp_path}", "sampler.num_steps=2", "prompts.num_prompts=2", "lora.rank=0", "seed=5"])
    other = run_rollout(cfg, tmp_path / "other", progress=False)
    with pytest.raises(TrajectoryError, match="do not share their replay inputs"):
        compare(read(rollout_dir), other)

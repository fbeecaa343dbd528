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


def _edit_manifest(src: Path, dst: Path, edit) -> Path:
    bad = _copy(src, dst)
    m = json.loads((bad / "manifest.json").read_text())
    edit(m)
    (bad / "manifest.json").write_text(json.dumps(m))
    return bad


def _move_sigma(m: dict) -> None:
    m["sigma_table"][1] = m["steps"][0]["sigma_prev"] = m["steps"][1]["sigma"] = 0.5


@pytest.mark.parametrize("name, edit, message", [
    ("cut", lambda m: m.update(steps=m["steps"][:1]), "steps has 1 entries but the sigma table has 3 values"),
    ("empty", lambda m: m.update(steps=[]), "steps has 0 entries"),
    ("nogrid", lambda m: m.pop("grid"), "missing key 'grid'"),
    ("noconfig", lambda m: m.pop("config"), "missing key 'config'"),
    ("ids", lambda m: m.update(sample_ids=[0, 0]), "sample_ids must be a non-empty list of distinct integers"),
    ("hashes", lambda m: m["steps"][0]["x"].pop(), "step 0: x has 1 hashes for 2 samples"),
    ("steplabel", lambda m: m["steps"][1].update(step=0), "steps\\[1\\] is not the record of step 1"),
    ("sigma", lambda m: m["sigma_table"].__setitem__(1, 0.5), "step 0's sigmas do not match the sigma table"),
    ("sigmas", _move_sigma, "sigma_table does not match the stored sigma tensor"),
])
def test_inconsistent_manifest_is_refused(rollout_dir: Path, tmp_path: Path, name: str, edit, message: str) -> None:
    bad = _edit_manifest(rollout_dir, tmp_path / name, edit)
    with pytest.raises(TrajectoryError, match=message.replace("(", r"\(")):
        read(bad)


def test_tensor_shapes_are_checked(rollout_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from mmdit_strict.trajectories.hashing import file_sha256

    bad = _copy(rollout_dir, tmp_path / "shapes")
    tensors = load_file(str(bad / "tensors.safetensors"))
    del tensors["prompt.1"]
    save_file(tensors, str(bad / "tensors.safetensors"))
    m = json.loads((bad / "manifest.json").read_text())
    m["files"]["tensors.safetensors"] = file_sha256(str(bad / "tensors.safetensors"))
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TrajectoryError, match="prompt.1"):
        read(bad)


@pytest.mark.parametrize("side", [0, 1])
def test_compare_refuses_a_cut_manifest_on_either_side(rollout_dir: Path, tmp_path: Path, side: int,
                                                        capsys: pytest.CaptureFixture) -> None:
    from mmdit_strict.cli.main import main

    cut = _edit_manifest(rollout_dir, tmp_path / "cut", lambda m: m.update(steps=[]))
    args = [str(cut), str(rollout_dir)] if side == 0 else [str(rollout_dir), str(cut)]
    assert main(["compare", *args]) == 2
    assert "steps has 0 entries" in capsys.readouterr().err


def test_compare_is_symmetric(tmp_path: Path) -> None:
    from mmdit_strict.trajectories import run_recompute

    cfg = compose([f"output_dir={tmp_path}", "sampler.num_steps=2", "prompts.num_prompts=2", "recompute.runtime=off"])
    a = run_rollout(cfg, tmp_path / "rollout", progress=False)
    b = run_recompute(cfg, a, tmp_path / "recompute", progress=False)
    ab, ba = compare(a, b), compare(b, a)
    assert not ab.byte_identical and not ba.byte_identical
    assert (ab.first.step, ab.first.sample_id, ab.first.quantity) == (ba.first.step, ba.first.sample_id, ba.first.quantity)
    assert ab.differing == ba.differing and ab.first.max_ulp == ba.first.max_ulp

"""Training checkpoints: atomic (a crash while saving keeps the previous one), verified on read."""

from __future__ import annotations

import json
import os

import pytest
import torch

from mmdit_strict.training import checkpoint as ckpt


def _save(root, epoch: int, value: float):
    lora = {"a.lora_A.weight": torch.full((2, 3), value)}
    opt = {"optimizer": {"state": {}, "param_groups": []}, "scheduler": {"last_epoch": epoch}}
    return ckpt.save_checkpoint(root, epoch, lora, opt, {"epoch": epoch, "rng": ckpt.rng_state()})


def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch) -> None:
    _save(tmp_path, 0, 1.0)
    real = os.replace

    def crash(src, dst):
        if str(dst).endswith("epoch_000001"):
            raise OSError("disk full")
        return real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 1, 2.0)
    monkeypatch.setattr(ckpt.os, "replace", real)
    folder = ckpt.latest_checkpoint(tmp_path)
    assert folder.name == "epoch_000000"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".epoch")]  # no temp folder left
    data = ckpt.load_checkpoint(folder)
    assert torch.equal(data["lora"]["a.lora_A.weight"], torch.full((2, 3), 1.0))


def test_corrupt_files_are_named(tmp_path) -> None:
    folder = _save(tmp_path, 0, 1.0)
    good = (folder / "lora.safetensors").read_bytes()
    raw = bytearray(good)
    raw[-1] ^= 1
    (folder / "lora.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ckpt.TrainCheckpointError, match="lora.safetensors does not match the sha256"):
        ckpt.load_checkpoint(folder)
    (folder / "lora.safetensors").write_bytes(good)
    (folder / "optimizer.pt").unlink()
    with pytest.raises(ckpt.TrainCheckpointError, match="optimizer.pt is missing"):
        ckpt.load_checkpoint(folder)


def test_rng_state_round_trip() -> None:
    state = ckpt.rng_state()
    a = torch.rand(3)
    ckpt.set_rng_state(state)
    assert torch.equal(torch.rand(3), a)


def _rewrite_state(folder, **changes) -> None:
    state = json.loads((folder / ckpt.STATE).read_text())
    for key, value in changes.items():
        if value is None:
            state.pop(key, None)
        else:
            state[key] = value
    (folder / ckpt.STATE).write_text(json.dumps(state))


def _flip_last_byte(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1  # in the tensor data: the file still parses
    path.write_bytes(bytes(raw))


def test_file_list_is_required_and_complete(tmp_path) -> None:
    """trust row 8: an emptied, missing or partial file list in state.json is refused, naming what is unverified;
    so is a file in the folder that the list does not cover."""
    folder = _save(tmp_path, 0, 1.0)
    files = json.loads((folder / ckpt.STATE).read_text())["files"]
    _flip_last_byte(folder / "lora.safetensors")
    _rewrite_state(folder, files={})
    with pytest.raises(ckpt.TrainCheckpointError, match=r"'files'.*empty"):
        ckpt.load_checkpoint(folder)
    _rewrite_state(folder, files=None)
    with pytest.raises(ckpt.TrainCheckpointError, match=r"no 'files'"):
        ckpt.load_checkpoint(folder)
    _rewrite_state(folder, files={"optimizer.pt": files["optimizer.pt"]})
    with pytest.raises(ckpt.TrainCheckpointError, match=r"lora.safetensors is not listed"):
        ckpt.load_checkpoint(folder)
    _flip_last_byte(folder / "lora.safetensors")  # back to the saved bytes
    _rewrite_state(folder, files=files)
    ckpt.load_checkpoint(folder)
    (folder / "ema.safetensors").write_bytes((folder / "lora.safetensors").read_bytes())
    with pytest.raises(ckpt.TrainCheckpointError, match=r"ema.safetensors, not listed"):
        ckpt.load_checkpoint(folder)
    (folder / "ema.safetensors").unlink()
    _rewrite_state(folder, files={**files, "../lora.safetensors": files["lora.safetensors"]})
    with pytest.raises(ckpt.TrainCheckpointError, match=r"'\.\./lora.safetensors'"):
        ckpt.load_checkpoint(folder)


def test_latest_must_name_a_folder_of_this_run(tmp_path) -> None:
    """trust row 9: ``latest`` naming another run's checkpoint (by a relative path or through a symlink) is refused."""
    mine, other = tmp_path / "run" / "checkpoints", tmp_path / "other" / "checkpoints"
    _save(mine, 0, 1.0)
    _save(other, 0, 2.0)
    assert ckpt.latest_checkpoint(mine) == mine / "epoch_000000"
    for value in ("../../other/checkpoints/epoch_000000", str(other / "epoch_000000"), "..", ".", ""):
        (mine / ckpt.LATEST).write_text(value + "\n")
        with pytest.raises(ckpt.TrainCheckpointError, match="latest") as info:
            ckpt.latest_checkpoint(mine)
        assert repr(value) in str(info.value)
    (mine / "epoch_000001").symlink_to(other / "epoch_000000")
    (mine / ckpt.LATEST).write_text("epoch_000001\n")
    with pytest.raises(ckpt.TrainCheckpointError, match="epoch_000001.*outside"):
        ckpt.latest_checkpoint(mine)

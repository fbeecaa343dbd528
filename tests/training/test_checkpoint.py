"""Training checkpoints: atomic (a crash while saving keeps the previous one), verified on read."""

from __future__ import annotations

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

"""Checkpoints written in the background: the files of a direct write, from the state as it was at the save."""

from __future__ import annotations

import threading

import pytest
import torch

from mmdit_strict.training import checkpoint as ckpt
from mmdit_strict.training.checkpoint_writer import CheckpointWriter, host_snapshot


def _live_state(seed: int = 0):
    """A LoRA, an AdamW state after one step, and an EMA, as the trainer holds them."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(4, 8, generator=g)), torch.nn.Parameter(torch.randn(8, 4, generator=g))]
    opt = torch.optim.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    names = ["blocks.0.to_q.lora_A.default.weight", "blocks.0.to_q.lora_B.default.weight"]
    lora = {n: p.detach() for n, p in zip(names, params)}
    ema = {n: p.detach() * 0.5 for n, p in zip(names, params)}
    state = {"epoch": 0, "stat_tracker": {"prompt 0": [1.0, 2.0]}, "rng": ckpt.rng_state()}
    return params, opt, lora, ema, state


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_background_write_gives_the_direct_writes_files(tmp_path) -> None:
    params, opt, lora, ema, state = _live_state()
    direct = ckpt.save_checkpoint(tmp_path / "direct", 0, lora, {"optimizer": opt.state_dict()}, state, ema)
    writer = CheckpointWriter(background=True)
    writer.save(tmp_path / "background", 0, lora, {"optimizer": opt.state_dict()}, state, ema)
    folder = writer.wait()
    assert folder == tmp_path / "background" / "epoch_000000"
    assert ckpt.latest_checkpoint(tmp_path / "background") == folder
    a, b = _files(direct), _files(folder)
    assert sorted(a) == sorted(b) == ["ema.safetensors", "lora.safetensors", "optimizer.pt", "state.json"]
    for name in a:
        assert a[name] == b[name], name


def test_changes_after_the_save_do_not_reach_the_files(tmp_path, monkeypatch) -> None:
    """The next update changes the live LoRA, AdamW moments, EMA and state in place while the write is in flight;
    the checkpoint holds the values of the save."""
    params, opt, lora, ema, state = _live_state()
    before = ckpt.save_checkpoint(tmp_path / "before", 0, lora, {"optimizer": opt.state_dict()}, state, ema)
    gate = threading.Event()
    real = ckpt.save_file

    def held(*args, **kwargs):  # the write starts only once the trainer has moved on
        gate.wait(timeout=30)
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt, "save_file", held)
    writer = CheckpointWriter(background=True)
    try:
        writer.save(tmp_path / "later", 0, lora, {"optimizer": opt.state_dict()}, state, ema)
        assert writer.pending
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()  # moves the parameters (lora's tensors share them) and the moments in place
        for t in ema.values():
            t.mul_(3.0)
        state["stat_tracker"]["prompt 0"].append(9.0)
        state["epoch"] = 7
    finally:
        gate.set()
        folder = writer.wait()
    a, b = _files(before), _files(folder)
    for name in a:
        assert a[name] == b[name], name


def test_a_failed_background_write_is_raised_at_the_wait_and_keeps_the_previous(tmp_path, monkeypatch) -> None:
    _, opt, lora, ema, state = _live_state()
    writer = CheckpointWriter(background=True)
    writer.save(tmp_path, 0, lora, {"optimizer": opt.state_dict()}, state, ema)
    real = ckpt.os.replace

    def crash(src, dst):
        if str(dst).endswith("epoch_000001"):
            raise OSError("disk full")
        return real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", crash)
    writer.save(tmp_path, 1, lora, {"optimizer": opt.state_dict()}, state, ema)  # waits for epoch 0's write first
    with pytest.raises(RuntimeError, match=r"writing the checkpoint epoch_000001 .* failed: disk full"):
        writer.wait()
    assert ckpt.latest_checkpoint(tmp_path).name == "epoch_000000"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".epoch")]
    assert writer.wait() == tmp_path / "epoch_000000"  # the error is raised once


def test_a_direct_writer_raises_at_the_save(tmp_path, monkeypatch) -> None:
    _, opt, lora, _, state = _live_state()
    monkeypatch.setattr(ckpt.os, "replace", lambda src, dst: (_ for _ in ()).throw(OSError("disk full")))
    writer = CheckpointWriter(background=False)
    with pytest.raises(RuntimeError, match="disk full"):
        writer.save(tmp_path, 0, lora, {"optimizer": opt.state_dict()}, state)
    assert not writer.pending


def test_host_snapshot_copies_tensors_and_containers() -> None:
    t = torch.arange(6.0).view(2, 3).t()
    obj = {"a": [t, 1, "x"], "b": (t,), "c": None}
    snap = host_snapshot(obj)
    assert snap["a"][1:] == [1, "x"] and snap["c"] is None and isinstance(snap["b"], tuple)
    assert snap["a"] is not obj["a"]
    for copy in (snap["a"][0], snap["b"][0]):
        assert torch.equal(copy, t) and copy.stride() == t.stride()
        assert copy.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_a_later_snapshot_reuses_the_earlier_ones_memory_only_where_it_fits() -> None:
    a, b = torch.arange(6.0).view(2, 3), torch.arange(4.0)
    first = host_snapshot({"x": [a, b], "y": a})
    second = host_snapshot({"x": [a + 1, b[:3]], "y": a.t()}, first)
    assert second["x"][0] is first["x"][0] and torch.equal(second["x"][0], a + 1)  # same place, same layout
    assert second["x"][1] is not first["x"][1] and torch.equal(second["x"][1], b[:3])  # another shape
    assert second["y"] is not first["y"] and torch.equal(second["y"], a.t())  # other strides


def test_consecutive_background_writes_each_hold_their_own_values(tmp_path) -> None:
    """The second write reuses the first's host copy: its files must hold the second save's values, the first's
    files the first's."""
    params, opt, lora, ema, state = _live_state()
    writer = CheckpointWriter(background=True)
    expected = []
    for epoch in range(3):
        expected.append(ckpt.save_checkpoint(tmp_path / f"direct{epoch}", epoch, lora, {"optimizer": opt.state_dict()},
                                             state, ema))
        writer.save(tmp_path / "background", epoch, lora, {"optimizer": opt.state_dict()}, state, ema)
        for p in params:
            p.grad = torch.full_like(p, 0.1 * (epoch + 1))
        opt.step()
        for t in ema.values():
            t.add_(1.0)
    writer.wait()
    for epoch, direct in enumerate(expected):
        got = tmp_path / "background" / f"epoch_{epoch:06d}"
        a, b = _files(direct), _files(got)
        assert sorted(a) == sorted(b)
        for name in a:
            assert a[name] == b[name], (epoch, name)

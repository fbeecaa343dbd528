"""LoRA gradients are the same bytes for micro-batches of 1, 2 and 4; a killed run resumes to the same LoRA bytes;
resume refuses what it cannot trust (a changed config, fewer epochs, an unverified or foreign checkpoint)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from mmdit_strict.cli.main import main
from tests.training.conftest import compose_train
from mmdit_strict.training.checkpoint import latest_checkpoint, load_checkpoint
from mmdit_strict.training.loop import Trainer, run_training
from mmdit_strict.training.metrics import read_metrics
from tests.harness import assert_bytes_equal
from tests.training.conftest import SMALL


class _Recording(Trainer):
    """Keeps the (folded) gradients of every optimizer update."""

    def _step(self) -> float:
        self.grads.append({n: p.grad.clone() for n, p in self.named if p.grad is not None})
        return super()._step()


@pytest.mark.parametrize("checkpointing, cfg_layout", [(False, "sequential"), (True, "batched")])
def test_lora_grads_identical_for_micro_batches_1_2_4(tmp_path, checkpointing: bool, cfg_layout: str) -> None:
    runs = {}
    for mb, gas in ((1, 4), (2, 2), (4, 1)):  # 4 pairs per update in every layout → 3 updates over 12 pairs
        cfg = compose_train([f"output_dir={tmp_path / str(mb)}", *SMALL, "lora.init=random", f"train.micro_batch={mb}",
                       f"train.gradient_accumulation_steps={gas}", f"train.grad_checkpointing={str(checkpointing).lower()}",
                       f"train.cfg_layout={cfg_layout}"])
        tr = _Recording(cfg, progress=False)
        tr.grads = []
        row = tr.train_epoch(0)
        assert row["grad_fold"] == "sink" and row["optimizer_updates"] == 3
        runs[mb] = (tr.grads, {n: p.detach().clone() for n, p in tr.named})
    grads1, lora1 = runs[1]
    assert len(grads1) == 3 and all(len(g) > 0 for g in grads1)
    assert any(float(g.abs().max()) > 0 for g in grads1[0].values())
    for mb in (2, 4):
        grads, lora = runs[mb]
        for u, (ga, gb) in enumerate(zip(grads1, grads)):
            assert sorted(ga) == sorted(gb)
            for name in ga:
                assert_bytes_equal(gb[name], ga[name], f"micro_batch={mb} update {u} grad {name}")
        for name in lora1:
            assert_bytes_equal(lora[name], lora1[name], f"micro_batch={mb} LoRA {name} after the epoch")


def test_streamed_sink_gives_the_stored_bytes_with_a_bounded_buffer(tmp_path) -> None:
    """train.grad_sink=streamed (shuffled or key-sorted micro-batches, tree nodes parked or not) and =stored: the
    same gradient bytes;
    the streamed fold buffers no more than its bound, one micro-batch's keys minus one when sorted."""
    runs = {}
    for name, extra in (("stored", ["train.grad_sink=stored", "train.sort_update_pairs=false"]),
                        ("streamed", ["train.grad_sink=streamed", "train.sort_update_pairs=false"]),
                        ("sorted", ["train.grad_sink=streamed", "train.sort_update_pairs=true"]),
                        ("parked", ["train.grad_sink=streamed", "train.park_fold_nodes=true"]),
                        ("parked_at_join", ["train.grad_sink=streamed", "train.park_fold_nodes=true",
                                            "train.park_lookahead=0"])):
        cfg = compose_train([f"output_dir={tmp_path / name}", *SMALL, "lora.init=random", "train.micro_batch=2",
                       "train.gradient_accumulation_steps=3", *extra])
        tr = _Recording(cfg, progress=False)
        tr.grads = []
        row = tr.train_epoch(0)
        assert row["grad_fold"] == "sink" and row["optimizer_updates"] == 2, row
        if name.startswith("parked"):  # the second update parks into the host buffers the first one made
            assert tr.park_buffers.allocated > 0 and tr.park_buffers.reused > 0
        runs[name] = (tr.grads, row)
    keys_per_update = 6 * 2  # 6 pairs × 2 CFG branches
    stored, streamed, ordered = runs["stored"][1], runs["streamed"][1], runs["sorted"][1]
    assert stored["grad_sink_peak_per_param"] == stored["grad_sink_bound_per_param"] == keys_per_update
    assert streamed["grad_sink_peak_per_param"] <= streamed["grad_sink_bound_per_param"] < keys_per_update
    assert ordered["grad_sink_bound_per_param"] == 2 * 2 - 1  # one micro-batch (2 pairs × 2 branches) minus one
    assert ordered["grad_sink_peak_per_param"] <= 3
    assert ordered["grad_sink_peak_buffer_mb"] < streamed["grad_sink_peak_buffer_mb"] < stored["grad_sink_peak_buffer_mb"]
    # train.park_fold_nodes: the waiting tree nodes went to the host and back, the bytes did not change
    assert runs["parked"][1]["grad_sink_parked_peak_mb"] > 0 and ordered["grad_sink_parked_peak_mb"] == 0
    # train.park_lookahead=0: every covered node parks (more of them on the host at once), same bytes
    assert runs["parked_at_join"][1]["grad_sink_parked_peak_mb"] > runs["parked"][1]["grad_sink_parked_peak_mb"]
    for name in ("streamed", "sorted", "parked", "parked_at_join"):
        for u, (ga, gb) in enumerate(zip(runs["stored"][0], runs[name][0])):
            assert sorted(ga) == sorted(gb)
            for p in ga:
                assert_bytes_equal(gb[p], ga[p], f"grad_sink {name} update {u} grad {p}")


class _Killed(Exception):
    pass


COMMON = [*SMALL, "train.num_epochs=4", "train.save_freq=1", "train.micro_batch=2", "train.gradient_accumulation_steps=2",
          "train.ema=true", "train.eval_freq=2", "train.lr_warmup_steps=3"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    return out, run_training(compose_train([f"output_dir={out}", *COMMON]), progress=False)


def test_strict_training_skips_autograd_sums_with_the_same_bytes(tmp_path, monkeypatch) -> None:
    """Under the strict runtime the trainer's sink takes no autograd sums (the backward leaves ``.grad`` unwritten and
    the fold sets it): the same folded gradients and LoRA bytes as a sink that also lets autograd sum them."""
    from mmdit_strict.kernels.grad_sink import SampleGradSink
    from mmdit_strict.training import loop

    runs = {}
    for name in ("default", "with_sums"):
        if name == "with_sums":
            monkeypatch.setattr(loop, "SampleGradSink", lambda *a, **k: SampleGradSink(*a, **{**k, "autograd_sums": True}))
        cfg = compose_train([f"output_dir={tmp_path / name}", *SMALL, "lora.init=random", "train.micro_batch=2",
                             "train.gradient_accumulation_steps=3"])
        tr = _Recording(cfg, progress=False)
        tr.grads, made = [], []
        real_add = SampleGradSink.add
        monkeypatch.setattr(SampleGradSink, "add", lambda self, *a, **k: made.append(self.autograd_sums) or real_add(self, *a, **k))
        row = tr.train_epoch(0)
        monkeypatch.setattr(SampleGradSink, "add", real_add)
        assert row["grad_fold"] == "sink" and row["optimizer_updates"] == 2 and made
        assert set(made) == {name == "with_sums"}
        runs[name] = (tr.grads, {n: p.detach().clone() for n, p in tr.named})
    (ga_all, la), (gb_all, lb) = runs["default"], runs["with_sums"]
    for u, (ga, gb) in enumerate(zip(ga_all, gb_all, strict=True)):
        assert sorted(ga) == sorted(gb) and ga
        for n in ga:
            assert_bytes_equal(ga[n], gb[n], f"update {u} grad {n}")
    for n in la:
        assert_bytes_equal(la[n], lb[n], f"LoRA {n} after the epoch")


# (epoch, update) where the run dies: before the first checkpoint, mid-epoch, on an epoch's first update
# (3 updates per epoch: 12 pairs, 4 per update)
@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [(0, 1), (2, 1), (3, 0)])
def test_kill_and_resume_gives_the_same_lora_bytes(tmp_path, uninterrupted, kill_at) -> None:
    full_dir, full = uninterrupted

    def kill(epoch: int, inner: int, update: int) -> None:
        if (epoch, update) == kill_at:
            raise _Killed

    out = tmp_path / "killed"
    with pytest.raises(_Killed):
        run_training(compose_train([f"output_dir={out}", *COMMON]), progress=False, on_update=kill)
    last = latest_checkpoint(out / "checkpoints") if (out / "checkpoints").exists() else None
    assert (last.name if last else None) == (f"epoch_{kill_at[0] - 1:06d}" if kill_at[0] else None)
    resumed = run_training(compose_train([f"output_dir={out}", *COMMON, "resume=true"]), progress=False)
    for name, t in full.lora.items():
        assert_bytes_equal(resumed.lora[name], t, f"LoRA {name}")
    a = load_checkpoint(latest_checkpoint(full_dir / "checkpoints"))
    b = load_checkpoint(latest_checkpoint(out / "checkpoints"))
    for name in a["ema"]:
        assert_bytes_equal(b["ema"][name], a["ema"][name], f"EMA {name}")
    for i, st in a["optimizer"]["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert_bytes_equal(b["optimizer"]["optimizer"]["state"][i][key], st[key], f"AdamW {key} of param {i}")
    assert a["optimizer"]["scheduler"] == b["optimizer"]["scheduler"]
    assert a["state"]["stat_tracker"] == b["state"]["stat_tracker"]
    # the metrics file describes one uninterrupted history
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time", "peak_memory"))} for r in rows]
    assert strip(resumed.metrics) == strip(full.metrics)


def test_resume_refuses_a_different_config(tmp_path) -> None:
    run_training(compose_train([f"output_dir={tmp_path}", *SMALL, "train.num_epochs=1"]), progress=False)
    with pytest.raises(ValueError, match="pass resume=true"):
        run_training(compose_train([f"output_dir={tmp_path}", *SMALL, "train.num_epochs=2"]), progress=False)
    with pytest.raises(ValueError, match=r"config differs .*train.learning_rate"):
        run_training(compose_train([f"output_dir={tmp_path}", *SMALL, "train.num_epochs=2", "resume=true", "train.learning_rate=0.01"]),
                     progress=False)
    res = run_training(compose_train([f"output_dir={tmp_path}", *SMALL, "train.num_epochs=2", "resume=true"]), progress=False)
    assert [r["epoch"] for r in res.metrics] == [0, 1]


def _copy_run(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.slow
def test_resume_refuses_fewer_epochs_than_finished(tmp_path, uninterrupted, capsys) -> None:
    """trust row 10: train.num_epochs below the epochs a run already finished is exit 2 naming both counts;
    the same count is a resume with nothing left to train."""
    out = _copy_run(uninterrupted[0], tmp_path / "run")
    cmd = ["train", f"output_dir={out}", *COMMON, "resume=true", "--quiet"]
    assert main([*cmd, "train.num_epochs=3"]) == 2
    err = capsys.readouterr().err
    assert "already finished 4 epochs" in err and "train.num_epochs=3" in err and "train.num_epochs>=4" in err, err
    assert main([*cmd, "train.num_epochs=4"]) == 0
    assert len(read_metrics(out)) == 4


@pytest.mark.slow
def test_resume_verifies_the_checkpoint_it_reads(tmp_path, uninterrupted, capsys) -> None:
    """trust rows 8 and 9 through `mmdit-strict train`: an emptied file list over a corrupt LoRA, and a `latest`
    naming another run's checkpoint, are exit 2 naming the file / the value (never a resume)."""
    out = _copy_run(uninterrupted[0], tmp_path / "run")
    _copy_run(uninterrupted[0], tmp_path / "other")
    cmd = ["train", f"output_dir={out}", *COMMON, "resume=true", "--quiet"]
    folder = out / "checkpoints" / "epoch_000003"
    state = json.loads((folder / "state.json").read_text())
    (folder / "state.json").write_text(json.dumps({**state, "files": {}}))
    raw = bytearray((folder / "lora.safetensors").read_bytes())
    raw[-1] ^= 1
    (folder / "lora.safetensors").write_bytes(bytes(raw))
    assert main(cmd) == 2
    err = capsys.readouterr().err
    assert "state.json" in err and "'files'" in err, err
    value = "../../other/checkpoints/epoch_000003"
    (out / "checkpoints" / "latest").write_text(value + "\n")
    assert main(cmd) == 2
    err = capsys.readouterr().err
    assert repr(value) in err, err


@pytest.mark.slow
def test_resume_repairs_a_torn_metrics_tail(tmp_path, uninterrupted, caplog) -> None:
    """trust row 11 through `mmdit-strict train`: a metrics.jsonl whose last append was cut short resumes
    (exit 0) with the file cut back to its last whole line and a warning naming it."""
    out = _copy_run(uninterrupted[0], tmp_path / "run")
    whole = (out / "metrics.jsonl").read_text()
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write('{"epoch": 4, "rew')
    with caplog.at_level(logging.WARNING):
        assert main(["train", f"output_dir={out}", *COMMON, "resume=true", "--quiet"]) == 0
    assert (out / "metrics.jsonl").read_text() == whole
    assert any(str(out / "metrics.jsonl") in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


@pytest.mark.slow
def test_checkpoints_written_in_the_background_equal_the_direct_ones(tmp_path, uninterrupted) -> None:
    """train.async_checkpoint (default on), whose writes run while the next epoch changes the LoRA, AdamW and EMA in
    place, writes every checkpoint folder with the bytes `=false` writes before going on."""
    full_dir, _ = uninterrupted
    out = tmp_path / "direct"
    run_training(compose_train([f"output_dir={out}", *COMMON, "train.async_checkpoint=false"]), progress=False)
    folders = sorted(p.name for p in (full_dir / "checkpoints").iterdir() if p.is_dir())
    assert folders == [f"epoch_{e:06d}" for e in range(4)]
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == folders
    for name in folders:
        a, b = full_dir / "checkpoints" / name, out / "checkpoints" / name
        assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
        for f in a.iterdir():
            if f.name == "state.json":  # the global RNG states are the process's, which ran other tests in between
                sa, sb = (json.loads(p.read_text()) for p in (f, b / f.name))
                sa.pop("rng"), sb.pop("rng")
                assert sa == sb, name
            else:
                assert f.read_bytes() == (b / f.name).read_bytes(), f"{name}/{f.name}"

"""metrics.jsonl: a tail torn by a kill is repaired on resume; damage before the tail is an error naming the line."""

from __future__ import annotations

import json
import logging

import pytest

from mmdit_strict.training.metrics import METRICS, MetricLogger, peak_resident_set_mb, read_metrics, take_cuda_peaks

ROWS = [{"epoch": e, "reward_mean": 0.5 + e} for e in range(3)]


def _write(out, text: str) -> None:
    (out / METRICS).write_text(text)


def _lines(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_torn_last_line_is_repaired_on_resume(tmp_path, caplog) -> None:
    """trust row 11: a last line cut short by a kill (no newline) is not a row; resuming truncates the file to the
    last whole line with a warning naming the file."""
    _write(tmp_path, _lines(ROWS) + '{"epoch": 3, "rew')
    assert read_metrics(tmp_path) == ROWS
    with caplog.at_level(logging.WARNING, logger="mmdit_strict.training.metrics"):
        MetricLogger(tmp_path, "disabled", "p", None, {}, start_epoch=3).finish()
    assert (tmp_path / METRICS).read_text() == _lines(ROWS)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(tmp_path / METRICS) in warned[0], warned
    # a whole last row that only lacks its newline is kept
    _write(tmp_path, _lines(ROWS).rstrip("\n"))
    assert read_metrics(tmp_path) == ROWS


@pytest.mark.parametrize("bad", ['{"epoch": 1, "rew', "[1, 2]", '{"reward_mean": 1.0}'])
def test_damage_before_the_tail_names_the_line(tmp_path, bad: str) -> None:
    """trust row 11: a corrupt line that is not the torn tail is an error naming the file and the line number,
    on read and on resume (the history is never dropped silently)."""
    _write(tmp_path, _lines(ROWS[:1]) + bad + "\n" + _lines(ROWS[2:]))
    with pytest.raises(ValueError, match=rf"{METRICS}: line 2"):
        read_metrics(tmp_path)
    with pytest.raises(ValueError, match=rf"{METRICS}: line 2"):
        MetricLogger(tmp_path, "disabled", "p", None, {}, start_epoch=3)


def test_wandb_failure_when_closing_is_returned_not_raised(tmp_path, monkeypatch) -> None:
    """trust row 7 (train): wandb failing as its run closes, after the training, comes back as one line for the
    command to print after its result instead of an exception that would hide it."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    mlog = MetricLogger(tmp_path, "offline", "p", None, {}, start_epoch=0)
    mlog.log({"epoch": 0, "reward_mean": 1.0})
    real_finish = mlog.run.finish

    def unreachable(*args, **kwargs):
        real_finish()
        raise ConnectionError("wandb: the server cannot be reached")

    monkeypatch.setattr(mlog.run, "finish", unreachable)
    assert mlog.finish({"reward_mean_last": 1.0}) == "ConnectionError: wandb: the server cannot be reached"
    assert mlog.finish() is None  # closed once
    assert read_metrics(tmp_path) == [{"epoch": 0, "reward_mean": 1.0}]


def test_peak_memory_on_the_cpu_is_the_resident_set_and_no_reserved_peak() -> None:
    import torch

    assert peak_resident_set_mb() > 10  # this process's resident set, MiB
    assert take_cuda_peaks(torch.device("cpu")) is None  # CUDA allocator figures only


def test_epoch_costs_figure_draws_cuda_and_cpu_rows_and_skips_rows_without_times(tmp_path) -> None:
    """``epoch_costs.png``: stacked phase times per epoch with the memory peaks; rows without phase times (an older
    run's) draw nothing and write no file."""
    from mmdit_strict.training.metrics import plot_epoch_costs

    cuda = [{"epoch": e, "time_rollout_s": 44.0, "time_reward_s": 0.1, "time_train_s": 37.0, "time_optimizer_s": 0.3,
             "peak_memory_mb": 47476.6, "peak_memory_reserved_mb": 53410.0} for e in range(3)]
    cuda[2]["time_eval_s"] = 12.0
    cuda[2].update(peak_memory_rollout_mb=47125.6, peak_memory_reserved_rollout_mb=53410.0, peak_memory_train_mb=47476.6,
                   peak_memory_reserved_train_mb=51874.0)  # a row from a commit that logs each phase's peaks
    cpu = [{"epoch": 0, "time_rollout_s": 1.0, "time_train_s": 2.0, "peak_memory_mb": 900.0}]
    for name, rows in (("cuda", cuda), ("cpu", cpu)):
        out = plot_epoch_costs(rows, tmp_path / name / "epoch_costs.png", name)
        assert out is not None and out.read_bytes()[:4] == b"\x89PNG"
    assert plot_epoch_costs([{"epoch": 0, "reward_mean": 1.0}], tmp_path / "none.png", "old") is None
    assert not (tmp_path / "none.png").exists()


def test_memory_series_draws_each_phase_where_rows_have_it_and_the_epoch_where_not() -> None:
    """The figure's memory lines: per-phase CUDA peaks where the row has them (allocated solid, reserved dashed), the
    epoch's two peaks for an older CUDA row, the resident set for a CPU row; every value in GiB from the row's MiB."""
    from mmdit_strict.training.metrics import memory_series

    old = {"epoch": 0, "peak_memory_mb": 2048.0, "peak_memory_reserved_mb": 3072.0}
    new = {"epoch": 1, "peak_memory_mb": 47476.6, "peak_memory_reserved_mb": 53410.0,
           "peak_memory_rollout_mb": 47125.6, "peak_memory_reserved_rollout_mb": 53410.0,
           "peak_memory_train_mb": 47476.6, "peak_memory_reserved_train_mb": 51874.0}
    lines = {line["label"]: line for line in memory_series([old, new])}
    assert sorted(lines) == sorted(["rollout peak allocated GiB", "rollout peak reserved GiB", "train peak allocated GiB",
                                    "train peak reserved GiB", "peak allocated GiB", "peak reserved GiB"])
    rollout_colour = lines["rollout peak allocated GiB"]["color"]
    assert lines["rollout peak reserved GiB"] == {"label": "rollout peak reserved GiB", "color": rollout_colour,
                                                  "dashed": True, "epochs": [1], "gib": [53410.0 / 1024]}
    assert lines["train peak allocated GiB"]["epochs"] == [1] and not lines["train peak allocated GiB"]["dashed"]
    assert lines["train peak allocated GiB"]["color"] != lines["rollout peak allocated GiB"]["color"]
    assert lines["peak reserved GiB"]["epochs"] == [0] and lines["peak reserved GiB"]["gib"] == [3.0]  # the new row once
    cpu = memory_series([{"epoch": 0, "peak_memory_mb": 900.0}])
    assert [(c["label"], c["gib"]) for c in cpu] == [("peak resident set GiB (process)", [900.0 / 1024])]
    assert memory_series([{"epoch": 0, "time_train_s": 1.0}]) == []


def test_cost_line_names_each_phase_and_its_peaks() -> None:
    from mmdit_strict.training.metrics import cost_line

    row = {"epoch": 0, "time_rollout_s": 46.88, "time_reward_s": 0.17, "time_train_s": 45.04, "time_optimizer_s": 0.72,
           "peak_memory_mb": 47476.6, "peak_memory_reserved_mb": 53410.0, "peak_memory_rollout_mb": 47125.6,
           "peak_memory_reserved_rollout_mb": 53410.0, "peak_memory_train_mb": 47476.6,
           "peak_memory_reserved_train_mb": 51874.0}
    assert cost_line(row) == ("rollout 46.88 s, rewards 0.17 s, train 45.04 s, optimizer 0.72 s, peak GPU memory "
                              "allocated / reserved GiB: rollout 46.02 / 52.16; train 46.36 / 50.66")
    older = {k: v for k, v in row.items() if "rollout_mb" not in k and "train_mb" not in k}
    assert cost_line(older).endswith("peak GPU memory allocated / reserved: 46.36 / 52.16 GiB")
    assert cost_line({"time_train_s": 2.0, "peak_memory_mb": 512.0}) == "train 2.00 s, peak resident set 0.50 GiB"

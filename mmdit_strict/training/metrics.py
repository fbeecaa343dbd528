"""Training metrics: one JSON line per epoch in ``<output_dir>/metrics.jsonl``, mirrored to wandb.

wandb runs offline by default with its folder beside the outputs (``<output_dir>/wandb``); the run id
is kept in the checkpoint so a resumed run appends to the same wandb run. ``metrics.jsonl`` is cut
back to the resumed epoch on resume, so it always describes exactly one uninterrupted history.

A last line without its newline that does not parse is an append cut short (a kill mid-write): readers
skip it and a resume drops it with a warning. A damaged line before that is a :class:`MetricsError`
naming the file and line: history is never dropped silently.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from ..figures import PHASE_COLORS, pyplot, save_png
from ..io import atomic_write_text

logger = logging.getLogger(__name__)

METRICS = "metrics.jsonl"


def take_cuda_peaks(device: torch.device) -> tuple[float, float] | None:
    """CUDA: the allocated and reserved peaks on ``device`` (MiB) since the last reset, then a reset, so that the next
    phase's peaks start from what is held now (``max_memory_*`` restart at the current figures); None elsewhere, where
    the process's resident-set peak cannot be split into phases."""
    if device.type != "cuda":
        return None
    peaks = torch.cuda.max_memory_allocated(device) / 2**20, torch.cuda.max_memory_reserved(device) / 2**20
    torch.cuda.reset_peak_memory_stats(device)
    return peaks


def peak_resident_set_mb() -> float:
    """The process's peak resident set size (MiB): a run's memory figure where no CUDA allocator counts it."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


class MetricsError(ValueError):
    """``metrics.jsonl`` holds a damaged line before its last one."""


def _row(path: Path, lineno: int, raw: bytes) -> dict[str, Any]:
    try:
        row = json.loads(raw)
    except ValueError as exc:
        why = f"column {exc.colno}: {exc.msg}" if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise MetricsError(f"{path}: line {lineno} is not JSON ({why}); repair or remove that line") from exc
    if not isinstance(row, dict) or isinstance(row.get("epoch"), bool) or not isinstance(row.get("epoch"), int):
        raise MetricsError(f"{path}: line {lineno} is not an epoch row (a JSON object with an integer 'epoch'); "
                           "repair or remove that line")
    return row


def _read(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The rows of ``path`` and the byte count of its torn last line (0 when the file ends on a whole line)."""
    if not path.exists():
        return [], 0
    *whole, tail = path.read_bytes().split(b"\n")
    rows = [_row(path, i, raw) for i, raw in enumerate(whole, 1) if raw.strip()]
    if not tail.strip():
        return rows, 0
    try:
        json.loads(tail)
    except ValueError:
        return rows, len(tail)
    return [*rows, _row(path, len(whole) + 1, tail)], 0


def read_metrics(out_dir: str | Path) -> list[dict[str, Any]]:
    """The epoch rows of ``<out_dir>/metrics.jsonl`` ([] when absent).

    An unterminated last line that does not parse (an append in progress or cut short) is not a row and
    is skipped; any other damaged line raises :class:`MetricsError` naming the file and line number.
    """
    return _read(Path(out_dir) / METRICS)[0]


class MetricLogger:
    """Append epoch rows to ``metrics.jsonl`` and wandb (``mode``: offline | online | disabled).

    Opening it rewrites ``metrics.jsonl`` with the rows before ``start_epoch`` (a torn last line is
    dropped with a warning; other damage raises :class:`MetricsError`).
    """

    def __init__(self, out_dir: str | Path, mode: str, project: str, entity: str | None, config: dict,
                 start_epoch: int, run_id: str | None = None) -> None:
        self.out_dir = Path(out_dir)
        path = self.out_dir / METRICS
        rows, torn = _read(path)
        if torn:
            logger.warning("%s: dropped a torn last line (%d bytes without a newline: an append cut short); "
                           "the file now ends at its last whole line", path, torn)
        rows = [r for r in rows if r["epoch"] < start_epoch]
        atomic_write_text(self.out_dir / METRICS, "".join(json.dumps(r) + "\n" for r in rows))
        self.run = None
        self.run_id = run_id
        if mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(project=project, entity=entity, mode=mode, dir=str(self.out_dir), config=config,
                                  job_type="train", id=run_id, resume="allow", reinit="finish_previous")
            self.run_id = self.run.id

    def log(self, row: dict[str, Any]) -> None:
        with open(self.out_dir / METRICS, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.run is not None:
            scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            self.run.log(scalars, step=int(row["epoch"]))

    def finish(self, summary: dict[str, Any] | None = None) -> str | None:
        """Close the wandb run; returns wandb's error as one line instead of raising it, so a failure
        after the training (a sync that cannot reach the server) never hides the run's result."""
        if self.run is None:
            return None
        run, self.run = self.run, None
        try:
            for k, v in (summary or {}).items():
                run.summary[k] = v
            run.finish()
        except Exception as exc:  # wandb's errors have no common base class
            logger.error("wandb: closing the run failed: %s", exc)
            return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        return None


def plot_rewards(rows: list[dict[str, Any]], path: str | Path, title: str) -> Path:
    """Reward mean ± std per epoch (and the eval reward when present) as a PNG."""
    plt = pyplot()

    ep = [r["epoch"] for r in rows]
    mean = [r["reward_mean"] for r in rows]
    std = [r["reward_std"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    ax.plot(ep, mean, marker="o", ms=3, label="rollout reward (mean over the epoch's samples)")
    ax.fill_between(ep, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2, label="± std")
    ev = [(r["epoch"], r["eval_reward_mean"]) for r in rows if "eval_reward_mean" in r]
    if ev:
        ax.plot([e for e, _ in ev], [v for _, v in ev], marker="s", ms=3, label="eval reward (ODE sampler)")
    ax.set_xlabel("epoch")
    ax.set_ylabel("reward")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return save_png(fig, path, dpi="figure")


#: The epoch's phases as ``train`` times them (metrics keys), in the order they run.
EPOCH_PHASES = (("time_rollout_s", "rollout"), ("time_reward_s", "rewards"), ("time_train_s", "train"),
                ("time_optimizer_s", "optimizer"), ("time_eval_s", "eval"))


def cost_line(row: dict[str, Any]) -> str:
    """One line of an epoch row's costs for a terminal: seconds by phase, then the memory peaks (on CUDA allocated /
    reserved GiB, each phase's where the row has them; on the CPU the process's resident set)."""
    parts = [f"{label} {row[key]:.2f} s" for key, label in EPOCH_PHASES if row.get(key) is not None]

    def gib(key: str) -> float:
        return row[key] / 1024

    if "peak_memory_rollout_mb" in row:
        memory = "; ".join(f"{phase} {gib(f'peak_memory_{phase}_mb'):.2f} / {gib(f'peak_memory_reserved_{phase}_mb'):.2f}"
                           for phase in ("rollout", "train"))
        parts.append(f"peak GPU memory allocated / reserved GiB: {memory}")
    elif row.get("peak_memory_reserved_mb") is not None:
        parts.append(f"peak GPU memory allocated / reserved: {gib('peak_memory_mb'):.2f} / "
                     f"{gib('peak_memory_reserved_mb'):.2f} GiB")
    elif row.get("peak_memory_mb") is not None:
        parts.append(f"peak resident set {gib('peak_memory_mb'):.2f} GiB")
    return ", ".join(parts)


def memory_series(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The memory lines of ``epoch_costs.png``, each ``{"label", "color", "dashed", "epochs", "gib"}``.

    Rows with per-phase CUDA peaks give the rollout's and the train phase's allocated (solid) and reserved (dashed)
    peaks; CUDA rows without them the epoch's two peaks; CPU rows the process's resident set. A series holds only
    the rows that have its key, so a run resumed across versions draws every epoch once."""
    phased = [r for r in rows if "peak_memory_rollout_mb" in r]
    plain = [r for r in rows if "peak_memory_rollout_mb" not in r and r.get("peak_memory_mb") is not None]
    cuda = any(r.get("peak_memory_reserved_mb") is not None for r in plain)
    kinds = (("", "allocated", False), ("reserved_", "reserved", True))
    specs = [(phased, f"peak_memory_{kind}{phase}_mb", f"{phase} peak {label} GiB", PHASE_COLORS[phase], dashed)
             for phase in ("rollout", "train") for kind, label, dashed in kinds]
    specs += [(plain, "peak_memory_mb", "peak allocated GiB" if cuda else "peak resident set GiB (process)", "black", False),
              (plain, "peak_memory_reserved_mb", "peak reserved GiB", "gray", True)]
    series = []
    for subset, key, label, color, dashed in specs:
        points = [(r["epoch"], r[key] / 1024) for r in subset if r.get(key) is not None]
        if points:
            series.append({"label": label, "color": color, "dashed": dashed, "epochs": [e for e, _ in points],
                           "gib": [v for _, v in points]})
    return series


def plot_epoch_costs(rows: list[dict[str, Any]], path: str | Path, title: str) -> Path | None:
    """Wall seconds per epoch by phase (stacked) and the peak memory (right axis, GiB; :func:`memory_series`) as a
    PNG. None (nothing written) when no row has phase times."""
    rows = [r for r in rows if any(k in r for k, _ in EPOCH_PHASES)]
    if not rows:
        return None
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    ep = [r["epoch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 3.6), dpi=120)
    bottom = [0.0] * len(rows)
    for key, label in EPOCH_PHASES:
        heights = [float(r.get(key) or 0.0) for r in rows]
        if any(heights):
            ax.bar(ep, heights, bottom=bottom, label=label, width=0.8, color=PHASE_COLORS[label], alpha=0.55)
            bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xlabel("epoch")
    ax.set_ylabel("wall seconds")
    if len(ep) <= 12:  # one tick per epoch (a locator draws fractions around a lone epoch)
        ax.set_xticks(ep)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(min(ep) - 0.6, max(ep) + 0.6)
    handles, labels = ax.get_legend_handles_labels()
    series = memory_series(rows)
    if series:
        mem = ax.twinx()
        for line in series:
            mem.plot(line["epochs"], line["gib"], color=line["color"], marker="s" if line["dashed"] else "o", ms=3,
                     linestyle="--" if line["dashed"] else "-", label=line["label"])
        mem.set_ylabel("GiB")
        mem.set_ylim(0, max(max(line["gib"]) for line in series) * 1.2)
        more_handles, more_labels = mem.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4, frameon=False)
    ax.set_title(title, fontsize=9)
    return save_png(fig, path, dpi="figure")

"""Step checkpoints of a side that is still running, so a killed rollout or recompute resumes.

After every denoising step the side writes into ``<artifact>.partial/``: that step's tensors
(``step_XXXXX.safetensors``) and then a JSON with the steps done, per-block hashes, operator trace,
LoRA-gradient records and a key of everything the remaining steps depend on. A rerun with the
same key continues after the last finished step and produces the same bytes as an uninterrupted
run; anything else (another config, another rollout) discards the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..io import atomic_write, atomic_write_text
from ..kernels.trace import OperatorTrace
from .record import StepRecorder

# run-level keys that do not change what a side computes
_IGNORED = ("output_dir", "resume", "progress", "wandb", "compare", "_choices_")


def state_key(kind: str, cfg: DictConfig, extra: str = "", ignore: tuple[str, ...] = ()) -> str:
    """sha256 of the side's kind, its relevant config and ``extra`` (e.g. the rollout it replays)."""
    skip = _IGNORED + tuple(ignore)
    relevant = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in skip}
    blob = json.dumps({"kind": kind, "cfg": relevant, "extra": extra}, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def partial_dir(artifact_dir: str | Path) -> Path:
    d = Path(artifact_dir)
    return d.with_name(d.name + ".partial")


@dataclass
class Resumed:
    steps_done: int
    trace: OperatorTrace
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def save_step(artifact_dir: str | Path, key: str, rec: StepRecorder, step: int, trace: OperatorTrace,
              wall_s: float, extra: dict[str, Any] | None = None) -> None:
    """Record that ``step`` is done: its tensors in ``step_XXXXX.safetensors``, then ``state.json``.

    Both writes are atomic and the JSON goes last, so a kill at any point leaves a checkpoint
    that names only steps whose tensors are on disk. I/O per step is one step's tensors.
    """
    target = partial_dir(artifact_dir)
    target.mkdir(parents=True, exist_ok=True)
    tensors = {"v": rec.v[step].contiguous(), "x_next": rec.x[step + 1].contiguous(), "logp": rec.logp[step].contiguous()}
    if step == 0:
        tensors["x0"] = rec.x[0].contiguous()
    atomic_write(target / f"step_{step:05d}.safetensors", lambda p: save_file(tensors, str(p)))
    meta = {"key": key, "steps_done": step + 1, "blocks": rec.blocks, "trace": trace.record_dicts(),
            "wall_s": wall_s, "extra": extra or {}}
    atomic_write_text(target / "state.json", json.dumps(meta, default=str))


def load(artifact_dir: str | Path, key: str, rec: StepRecorder) -> Resumed | None:
    """Fill ``rec`` from a checkpoint made with ``key``; None (and the checkpoint dropped) otherwise."""
    target = partial_dir(artifact_dir)
    if not (target / "state.json").exists():
        discard(artifact_dir)
        return None
    try:
        meta = json.loads((target / "state.json").read_text())
        if meta.get("key") != key:
            raise ValueError("made with other settings")
        done = int(meta["steps_done"])
        for step in range(done):
            t = load_file(str(target / f"step_{step:05d}.safetensors"))
            if step == 0:
                if not torch.equal(t["x0"], rec.x[0]):
                    raise ValueError("initial latents differ")
            rec.v[step].copy_(t["v"])
            rec.x[step + 1].copy_(t["x_next"])
            rec.logp[step].copy_(t["logp"])
        rec.blocks = meta["blocks"]
        return Resumed(done, OperatorTrace.from_records(meta["trace"]), float(meta["wall_s"]), meta["extra"])
    except (OSError, ValueError, KeyError, RuntimeError, json.JSONDecodeError, SafetensorError, TypeError):
        discard(artifact_dir)
        return None


def discard(artifact_dir: str | Path) -> None:
    shutil.rmtree(partial_dir(artifact_dir), ignore_errors=True)

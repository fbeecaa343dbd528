"""Step checkpoints of a side that is still running, so a killed rollout or recompute resumes.

Layout of ``<artifact>.partial/``::

    state.json              the stage key (every content hash and setting the steps depend on);
                            written once when the side starts, never rewritten per step
    step_XXXXX.safetensors  one step's tensors: v, x_next, logp (and x0 for step 0), byte-stable
    steps.jsonl             one line appended per finished step: its number, the sha256 of its
                            step file, its per-block hashes, the operator trace so far, the wall
                            time so far and the side's per-step extra (e.g. the LoRA-gradient record)

A step counts as done only once its line is in ``steps.jsonl`` (the step file is written first,
atomically; the line is appended and fsynced after), so a kill at any point leaves a checkpoint
that names only steps whose files are on disk. Per step the I/O is that step's tensors and one
line: the checkpoint grows linearly with the steps.

A rerun resumes only under the same stage key (a mismatch names the parts that changed and starts
over). It then checks every recorded step file against its sha256, in order: the first step that
is missing, damaged or out of place ends the resume there, and the side recomputes from that
step, starting from the last good step's latents. The result is the same bytes as an
uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..io import atomic_write, atomic_write_text
from ..kernels.trace import OperatorTrace
from ..io import save_safetensors
from .hashing import file_sha256
from .record import StepRecorder
from .stagekey import describe_mismatch

logger = logging.getLogger(__name__)

STATE = "state.json"
LOG = "steps.jsonl"


def partial_dir(artifact_dir: str | Path) -> Path:
    d = Path(artifact_dir)
    return d.with_name(d.name + ".partial")


def step_file(target: Path, step: int) -> Path:
    return target / f"step_{step:05d}.safetensors"


@dataclass
class Resumed:
    """What a verified checkpoint restores: ``steps_done`` steps, the trace and wall time after them."""

    steps_done: int
    trace: OperatorTrace
    wall_s: float
    step_extras: list[Any] = field(default_factory=list)  # per finished step, what the side passed as ``extra``


def start(artifact_dir: str | Path, key: dict[str, Any]) -> None:
    """Begin a fresh checkpoint for a side with stage key ``key`` (dropping any older one)."""
    discard(artifact_dir)
    target = partial_dir(artifact_dir)
    target.mkdir(parents=True)
    atomic_write_text(target / STATE, json.dumps({"key": key}, sort_keys=True))
    atomic_write_text(target / LOG, "")


def save_step(artifact_dir: str | Path, rec: StepRecorder, step: int, trace: OperatorTrace, wall_s: float,
              extra: Any = None) -> None:
    """Record that ``step`` is done: its tensors in ``step_XXXXX.safetensors``, then one line in ``steps.jsonl``."""
    target = partial_dir(artifact_dir)
    tensors = {"v": rec.v[step], "x_next": rec.x[step + 1], "logp": rec.logp[step]}
    if step == 0:
        tensors["x0"] = rec.x[0]
    path = atomic_write(step_file(target, step), lambda p: save_safetensors(tensors, p))
    line = {"step": step, "sha256": file_sha256(str(path)), "blocks": rec.blocks[step], "trace": trace.record_dicts(),
            "wall_s": wall_s, "extra": extra}
    with open(target / LOG, "a") as fh:
        fh.write(json.dumps(line, sort_keys=True, default=str) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def load(artifact_dir: str | Path, key: dict[str, Any], rec: StepRecorder, label: str = "side") -> Resumed | None:
    """Fill ``rec`` from the verified steps of a checkpoint made under ``key``; None when none can be used.

    A checkpoint of another key is dropped (the log says which parts differ). Steps are restored in
    order up to the first one whose file is missing, damaged (sha256) or out of place; the log says
    where, and the steps from there on are dropped so the side recomputes them.
    """
    target = partial_dir(artifact_dir)
    if not (target / STATE).exists():
        discard(artifact_dir)
        return None
    try:
        stored = json.loads((target / STATE).read_text()).get("key")
    except (OSError, ValueError, AttributeError) as exc:
        logger.warning("%s: dropping its step checkpoint: %s is unreadable (%s)", label, STATE, exc)
        discard(artifact_dir)
        return None
    if stored != key:
        logger.warning("%s: dropping its step checkpoint, made with other inputs: %s", label,
                       describe_mismatch(stored if isinstance(stored, dict) else {}, key))
        discard(artifact_dir)
        return None
    lines = _read_log(target / LOG)
    good: list[dict[str, Any]] = []
    for step, line in enumerate(lines):
        problem = _restore_step(target, step, line, rec)
        if problem is not None:
            logger.warning("%s: step checkpoint %d %s; recomputing from step %d", label, step, problem, step)
            break
        good.append(line)
    if not good:
        discard(artifact_dir)
        return None
    _truncate(target, good)
    last = good[-1]
    for step, line in enumerate(good):
        rec.blocks[step] = line["blocks"]
    return Resumed(len(good), OperatorTrace.from_records(last["trace"]), float(last["wall_s"]), [g["extra"] for g in good])


def _read_log(path: Path) -> list[Any]:
    """The parsed lines of ``steps.jsonl`` up to the first one that is not valid JSON (a torn append)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return []
    out = []
    for raw in text.split("\n"):
        try:
            out.append(json.loads(raw))
        except ValueError:
            break
    return out


def _restore_step(target: Path, step: int, line: Any, rec: StepRecorder) -> str | None:
    """Copy one verified step into ``rec``; otherwise return what is wrong with it."""
    if not isinstance(line, dict) or line.get("step") != step or not isinstance(line.get("sha256"), str):
        return "has a malformed record"
    path = step_file(target, step)
    if not path.exists():
        return "is missing its file"
    if file_sha256(str(path)) != line["sha256"]:
        return f"does not match the sha256 recorded when it was written ({path.name} is damaged or was replaced)"
    try:
        t = load_file(str(path))
    except (SafetensorError, OSError, RuntimeError) as exc:
        return f"cannot be read ({exc})"
    shapes = {"v": rec.v[step].shape, "x_next": rec.x[step + 1].shape, "logp": rec.logp[step].shape}
    for name, shape in shapes.items():
        if name not in t or t[name].shape != shape or t[name].dtype != torch.float32:
            return f"holds no float32 {name} of shape {tuple(shape)}"
    if step == 0 and ("x0" not in t or not torch.equal(t["x0"], rec.x[0])):
        return "starts from other initial latents"
    if not all(k in line for k in ("blocks", "trace", "wall_s", "extra")):
        return "has an incomplete record"
    rec.v[step].copy_(t["v"])
    rec.x[step + 1].copy_(t["x_next"])
    rec.logp[step].copy_(t["logp"])
    return None


def _truncate(target: Path, good: list[dict[str, Any]]) -> None:
    """Keep only the verified steps: rewrite the log to them and remove later step files."""
    atomic_write_text(target / LOG, "".join(json.dumps(g, sort_keys=True, default=str) + "\n" for g in good))
    for path in target.glob("step_*.safetensors"):
        if int(path.stem.split("_")[1]) >= len(good):
            path.unlink()


def discard(artifact_dir: str | Path) -> None:
    shutil.rmtree(partial_dir(artifact_dir), ignore_errors=True)

"""Training checkpoints: everything a killed run needs to continue to the same bytes.

Layout under ``<output_dir>/checkpoints/``::

    epoch_000003/                 one folder per saved epoch (written as a temp folder, renamed into place)
        lora.safetensors          LoRA tensors by parameter name
        ema.safetensors           EMA of the LoRA (only with train.ema)
        optimizer.pt              AdamW state + LR schedule state (torch.save, weights_only loadable)
        state.json                epoch/update counters, stat tracker, RNG states, data position,
                                  the run's config and, under "files", the sha256 of every file above
    latest                        text: the name of the newest complete folder (atomic rename)

Guarantees: a crash while saving leaves the previous checkpoint and ``latest`` untouched. Reading
trusts nothing unverified and raises :class:`TrainCheckpointError` naming the file or value at fault:
``latest`` must name a folder directly inside this ``checkpoints/`` (after resolving symlinks), and
``state.json``'s ``files`` must list ``lora.safetensors``, ``optimizer.pt`` and every other file in the
folder, each matching its recorded sha256.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..io import atomic_write_text
from ..trajectories.hashing import file_sha256

LATEST = "latest"
STATE = "state.json"
#: Files every checkpoint holds (``ema.safetensors`` too with ``train.ema``).
REQUIRED = ("lora.safetensors", "optimizer.pt")


class TrainCheckpointError(ValueError):
    """A training checkpoint is missing, incomplete or corrupt."""


def rng_state() -> dict[str, Any]:
    """Global RNG states (only plug-in rewards could draw from them: every draw of ours is keyed)."""
    state: dict[str, Any] = {"python": repr(random.getstate()), "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import ast

    random.setstate(ast.literal_eval(state["python"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def save_checkpoint(root: str | Path, epoch: int, lora: dict[str, torch.Tensor], optimizer: dict[str, Any],
                    state: dict[str, Any], ema: dict[str, torch.Tensor] | None = None) -> Path:
    """Write checkpoint ``epoch_<epoch>`` under ``root`` atomically and point ``latest`` at it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"epoch_{epoch:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in lora.items()}, str(tmp / "lora.safetensors"))
        if ema is not None:
            save_file({k: v.detach().to("cpu").contiguous() for k, v in ema.items()}, str(tmp / "ema.safetensors"))
        torch.save(optimizer, tmp / "optimizer.pt")
        files = {p.name: file_sha256(p) for p in sorted(tmp.iterdir())}
        (tmp / STATE).write_text(json.dumps({**state, "files": files}, indent=1, sort_keys=True))
        for p in tmp.iterdir():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(root / LATEST, name + "\n")
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The folder ``latest`` names, or None when there is no checkpoint yet.

    ``latest`` must hold the plain name of a folder directly inside ``root`` that has a ``state.json``;
    a path, ``.``/``..``, or a name whose folder resolves outside ``root`` (a symlink) is refused with
    :class:`TrainCheckpointError` naming the value.
    """
    root = Path(root)
    ptr = root / LATEST
    if not ptr.exists():
        return None
    value = ptr.read_text().strip()
    if not value or value in (".", "..") or "/" in value or "\\" in value:
        raise TrainCheckpointError(f"{ptr} holds {value!r}, which is not the name of a checkpoint folder in {root}")
    folder = root / value
    if folder.resolve().parent != root.resolve():
        raise TrainCheckpointError(f"{ptr} names {value!r}, which resolves to {folder.resolve()}, outside {root.resolve()}: "
                                   "a run resumes only from its own checkpoints")
    if not (folder / STATE).is_file():
        raise TrainCheckpointError(f"{ptr} names {value!r}, which has no {STATE}: the checkpoint folder was removed or damaged")
    return folder


def _verified_files(folder: Path, state: Any) -> dict[str, str]:
    """``state["files"]`` after checking it covers the folder and every listed file matches its sha256."""
    where = folder / STATE
    if not isinstance(state, dict):
        raise TrainCheckpointError(f"{where} is not a JSON object")
    if "files" not in state:
        raise TrainCheckpointError(f"{where} has no 'files' list: the checkpoint's files cannot be verified")
    files = state["files"]
    if not isinstance(files, dict) or not files:
        raise TrainCheckpointError(f"{where}: 'files' is empty or not a name → sha256 mapping: the checkpoint's files "
                                   "cannot be verified")
    for name, digest in files.items():
        if not isinstance(name, str) or Path(name).name != name or name in (".", "..", STATE):
            raise TrainCheckpointError(f"{where}: 'files' lists {name!r}, which is not a file name of this folder")
        if not isinstance(digest, str):
            raise TrainCheckpointError(f"{where}: 'files' gives {name!r} a sha256 of {digest!r}")
    for name in REQUIRED:
        if name not in files:
            raise TrainCheckpointError(f"{folder / name} is not listed in {STATE}'s 'files': it cannot be verified")
    unlisted = sorted(p.name for p in folder.iterdir() if p.name != STATE and p.name not in files)
    if unlisted:
        raise TrainCheckpointError(f"{folder} holds {', '.join(unlisted)}, not listed in {STATE}'s 'files': "
                                   "files the checkpoint did not record are not trusted")
    for name, digest in files.items():
        path = folder / name
        if not path.is_file():
            raise TrainCheckpointError(f"{path} is missing (listed in {STATE})")
        if file_sha256(path) != digest:
            raise TrainCheckpointError(f"{path} does not match the sha256 recorded in {STATE}: corrupt or modified")
    return files


def load_checkpoint(folder: str | Path, device: str | torch.device = "cpu") -> dict[str, Any]:
    """Read and verify a checkpoint folder: ``{"lora", "ema" (or None), "optimizer", "state"}``.

    Raises :class:`TrainCheckpointError` unless ``state.json`` lists (under ``files``) ``lora.safetensors``,
    ``optimizer.pt`` and every other file in the folder, each present and matching its sha256.
    """
    folder = Path(folder)
    try:
        state = json.loads((folder / STATE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TrainCheckpointError(f"cannot read {folder / STATE}: {exc}") from exc
    files = _verified_files(folder, state)
    lora = load_file(str(folder / "lora.safetensors"), device=str(device))
    ema = load_file(str(folder / "ema.safetensors"), device=str(device)) if "ema.safetensors" in files else None
    optimizer = torch.load(folder / "optimizer.pt", map_location=device, weights_only=True)
    return {"lora": lora, "ema": ema, "optimizer": optimizer, "state": state}

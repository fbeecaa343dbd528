"""Training checkpoints: everything a killed run needs to continue to the same bytes.

Layout under ``<output_dir>/checkpoints/``::

    epoch_000003/                 one folder per saved epoch (written as a temp folder, renamed into place)
        lora.safetensors          LoRA tensors by parameter name
        ema.safetensors           EMA of the LoRA (only with train.ema)
        optimizer.pt              AdamW state + LR schedule state (torch.save, weights_only loadable)
        state.json                epoch/update counters, stat tracker, RNG states, data position,
                                  the run's config and the sha256 of every file above
    latest                        text: the name of the newest complete folder (atomic rename)

Guarantees: a crash while saving leaves the previous checkpoint and ``latest`` untouched; reading
verifies every file against the sha256 recorded in ``state.json`` and raises
:class:`TrainCheckpointError` naming the file that does not match.
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
    """The folder ``latest`` names, or None when there is no checkpoint yet."""
    ptr = Path(root) / LATEST
    if not ptr.exists():
        return None
    folder = Path(root) / ptr.read_text().strip()
    if not (folder / STATE).exists():
        raise TrainCheckpointError(f"{ptr} names {folder.name}, which has no {STATE}: the checkpoint folder was removed or damaged")
    return folder


def load_checkpoint(folder: str | Path, device: str | torch.device = "cpu") -> dict[str, Any]:
    """Read and verify a checkpoint folder: ``{"lora", "ema" (or None), "optimizer", "state"}``."""
    folder = Path(folder)
    try:
        state = json.loads((folder / STATE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TrainCheckpointError(f"cannot read {folder / STATE}: {exc}") from exc
    for fname, digest in state.get("files", {}).items():
        path = folder / fname
        if not path.exists():
            raise TrainCheckpointError(f"{path} is missing (listed in {STATE})")
        if file_sha256(path) != digest:
            raise TrainCheckpointError(f"{path} does not match the sha256 recorded in {STATE}: corrupt or modified")
    lora = load_file(str(folder / "lora.safetensors"), device=str(device))
    ema = load_file(str(folder / "ema.safetensors"), device=str(device)) if (folder / "ema.safetensors").exists() else None
    optimizer = torch.load(folder / "optimizer.pt", map_location=device, weights_only=True)
    return {"lora": lora, "ema": ema, "optimizer": optimizer, "state": state}

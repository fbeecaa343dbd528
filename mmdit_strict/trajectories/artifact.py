"""Trajectory artifacts: a JSON manifest plus safetensors, written atomically and verified on read.

Layout of an artifact folder::

    manifest.json         format/version, fingerprint, resolved config, weight/LoRA/prompt hashes,
                          sigma table, CFG scale, noise keys, runtime, trace summary, software,
                          hardware, and per step × sample the sha256 of v_t, x_{t+1}, logp_t
    tensors.safetensors   replay inputs (initial latents, sigma table, prompt embeddings) and,
                          when saved, v (S, N, T, C), x (S+1, N, T, C), logp (S, N)

The folder is built under a temporary name and renamed into place, so a reader never sees a half
written artifact. Reading checks the format version, the tensor file's sha256 and every per-step
hash against the stored tensors.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .hashing import file_sha256, tensor_sha256

FORMAT = "mmdit-strict-trajectory"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TENSORS = "tensors.safetensors"


class TrajectoryError(ValueError):
    """An artifact is missing, corrupt, truncated, from another format version, or inconsistent."""


@dataclass
class Trajectory:
    """An artifact in memory. ``tensors`` holds replay inputs and (optionally) per-step tensors."""

    manifest: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    path: Path | None = None

    @property
    def num_steps(self) -> int:
        return len(self.manifest["steps"])

    @property
    def sample_ids(self) -> list[int]:
        return list(self.manifest["sample_ids"])

    def step_hashes(self, step: int, what: str) -> list[str]:
        return self.manifest["steps"][step][what]

    def has_tensors(self) -> bool:
        return all(k in self.tensors for k in ("v", "x", "logp"))


def software_info() -> dict[str, Any]:
    from .. import __version__

    info: dict[str, Any] = {"mmdit_strict": __version__, "torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def hardware_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
                            "cpu_threads": torch.get_num_threads()}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def write(traj: Trajectory, directory: str | Path) -> Path:
    """Write ``traj`` into ``directory`` atomically and return the path."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in traj.tensors.items()}
        save_file(tensors, str(tmp / TENSORS), metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION)})
        manifest = dict(traj.manifest)
        manifest["format"] = FORMAT
        manifest["format_version"] = FORMAT_VERSION
        manifest["files"] = {TENSORS: file_sha256(str(tmp / TENSORS))}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=False, default=str))
        for f in (tmp / TENSORS, tmp / MANIFEST):
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
            os.replace(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    traj.manifest = manifest
    traj.path = directory
    return directory


def read(directory: str | Path, *, verify: bool = True) -> Trajectory:
    """Read and verify an artifact; any inconsistency raises :class:`TrajectoryError` saying what."""
    directory = Path(directory)
    mpath, tpath = directory / MANIFEST, directory / TENSORS
    if not mpath.exists():
        raise TrajectoryError(f"{directory} is not a trajectory artifact: no {MANIFEST}")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TrajectoryError(f"{mpath} is corrupt or truncated (invalid JSON: {exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise TrajectoryError(f"{mpath} is not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise TrajectoryError(
            f"{directory} has format version {manifest.get('format_version')}, this mmdit_strict reads version {FORMAT_VERSION}"
        )
    if not tpath.exists():
        raise TrajectoryError(f"{directory} is missing {TENSORS}")
    expected = manifest.get("files", {}).get(TENSORS)
    actual = file_sha256(str(tpath))
    if verify and expected != actual:
        raise TrajectoryError(f"{tpath} is corrupt or truncated: sha256 {actual[:16]}… does not match the manifest's {str(expected)[:16]}…")
    try:
        tensors = load_file(str(tpath))
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise TrajectoryError(f"{tpath} cannot be read: {exc}") from exc
    traj = Trajectory(manifest, tensors, directory)
    if verify:
        verify_hashes(traj)
    return traj


def verify_hashes(traj: Trajectory) -> None:
    """Check every stored tensor against the per-step hashes in the manifest."""
    m = traj.manifest
    if tensor_sha256(traj.tensors["sigmas"]) != m["sigma_sha256"]:
        raise TrajectoryError("sigma table does not match its hash in the manifest")
    if tensor_sha256(traj.tensors["init_latents"]) != m["init_latents_sha256"]:
        raise TrajectoryError("initial latents do not match their hash in the manifest")
    if not traj.has_tensors():
        return
    for s, step in enumerate(m["steps"]):
        for what, key in (("v", "v"), ("x", "x"), ("logp", "logp")):
            tensor = traj.tensors[key][s + 1] if key == "x" else traj.tensors[key][s]
            for n, h in enumerate(step[what]):
                if tensor_sha256(tensor[n]) != h:
                    raise TrajectoryError(f"step {s} sample {m['sample_ids'][n]}: stored {what} does not match its hash")

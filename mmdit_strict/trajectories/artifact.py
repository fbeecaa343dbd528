"""Trajectory artifacts: a JSON manifest plus safetensors, written atomically and verified on read.

Layout of an artifact folder::

    manifest.json         format/version, fingerprint, resolved config, weight/LoRA/prompt hashes,
                          sigma table, CFG scale, noise keys, runtime, trace summary, software,
                          hardware, and per step × sample the sha256 of v_t, x_{t+1}, logp_t
    tensors.safetensors   replay inputs (initial latents, sigma table, prompt embeddings) and,
                          when saved, v (S, N, T, C), x (S+1, N, T, C), logp (S, N)

The folder is built under a temporary name and renamed into place, so a reader never sees a half
written artifact. The tensor file is byte-stable: tensors in name order, header keys sorted, fixed
metadata, so identical runs write identical files. Reading checks the format version, the
manifest against itself (schema, one step record per sigma-table interval, one hash per sample),
the tensor file's sha256, every tensor's shape, and every per-step hash against the stored tensors.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..io import replace_dir, save_safetensors
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
        save_safetensors(tensors, tmp / TENSORS, metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION)})
        manifest = dict(traj.manifest)
        manifest["format"] = FORMAT
        manifest["format_version"] = FORMAT_VERSION
        manifest["files"] = {TENSORS: file_sha256(str(tmp / TENSORS))}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=False, default=str))
        for f in (tmp / TENSORS, tmp / MANIFEST):
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        replace_dir(tmp, directory)
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
    check_manifest(manifest, mpath)
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
    check_tensors(traj)
    if verify:
        verify_hashes(traj)
    return traj


_NUMBER = (int, float)
_SCHEMA: dict[str, tuple[type, ...]] = {
    "kind": (str,), "config": (dict,), "runtime": (str,), "side": (dict,), "fingerprint": (str,),
    "weights_sha256": (str,), "lora_sha256": (str, type(None)), "prompt_hashes": (dict,), "sample_ids": (list,),
    "grid": (list,), "sigma_table": (list,), "sigma_sha256": (str,), "init_latents_sha256": (str,),
    "cfg_scale": _NUMBER, "eta": _NUMBER, "sde": (bool,), "noise": (dict,), "trace": (dict,),
    "software": (dict,), "wall_seconds": _NUMBER, "steps": (list,), "files": (dict,),
}


def require_kind(traj: Trajectory, kind: str) -> Trajectory:
    """``traj`` itself when its manifest's kind is ``kind`` (rollout | recompute); else :class:`TrajectoryError` saying which."""
    got = traj.manifest.get("kind")
    if got != kind:
        raise TrajectoryError(f"{traj.path or 'artifact'} is a {got} artifact where a {kind} artifact belongs")
    return traj


def check_manifest(m: dict[str, Any], where: str | Path) -> None:
    """Raise :class:`TrajectoryError` unless ``m`` is a well-formed, self-consistent manifest.

    Checks the keys and their types, one step record per sigma-table interval (step ``i`` labelled
    ``i``, with the table's sigmas), and one v/x/logp hash per sample in every step.
    """
    for key, types in _SCHEMA.items():
        if key not in m:
            raise TrajectoryError(f"{where}: missing key {key!r}")
        if not isinstance(m[key], types) or (types == _NUMBER and isinstance(m[key], bool)):
            raise TrajectoryError(f"{where}: {key!r} has type {type(m[key]).__name__}, expected {' or '.join(t.__name__ for t in types)}")
    if m["kind"] not in ("rollout", "recompute"):
        raise TrajectoryError(f"{where}: kind {m['kind']!r} is neither rollout nor recompute")
    ids = m["sample_ids"]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids) or len(set(ids)) != len(ids):
        raise TrajectoryError(f"{where}: sample_ids must be a non-empty list of distinct integers, got {ids!r}")
    grid = m["grid"]
    if len(grid) != 2 or not all(isinstance(g, int) and not isinstance(g, bool) and g > 0 for g in grid):
        raise TrajectoryError(f"{where}: grid must be two positive integers, got {grid!r}")
    sig = m["sigma_table"]
    if len(sig) < 2 or not all(isinstance(v, _NUMBER) and not isinstance(v, bool) and math.isfinite(v) for v in sig):
        raise TrajectoryError(f"{where}: sigma_table must hold at least 2 finite numbers, got {len(sig)} entries")
    S, N = len(sig) - 1, len(ids)
    if len(m["steps"]) != S:
        raise TrajectoryError(f"{where}: steps has {len(m['steps'])} entries but the sigma table has {S + 1} values ({S} steps)")
    for i, step in enumerate(m["steps"]):
        if not isinstance(step, dict) or step.get("step") != i:
            raise TrajectoryError(f"{where}: steps[{i}] is not the record of step {i}")
        if step.get("sigma") != sig[i] or step.get("sigma_prev") != sig[i + 1]:
            raise TrajectoryError(f"{where}: step {i}'s sigmas do not match the sigma table")
        for q in ("v", "x", "logp"):
            hashes = step.get(q)
            if not isinstance(hashes, list) or len(hashes) != N or not all(isinstance(h, str) for h in hashes):
                got = len(hashes) if isinstance(hashes, list) else "no"
                raise TrajectoryError(f"{where}: step {i}: {q} has {got} hashes for {N} samples")
    prompts = m["prompt_hashes"].get("prompts")
    if not isinstance(prompts, list) or len(prompts) != N or not isinstance(m["prompt_hashes"].get("negative"), str):
        raise TrajectoryError(f"{where}: prompt_hashes must hold one hash per sample ({N}) and the negative prompt's")
    keys = m["noise"].get("keys")
    if not isinstance(keys, dict) or set(keys) != {str(i) for i in ids} or any(len(k) != S for k in keys.values()):
        raise TrajectoryError(f"{where}: noise keys must name every sample id with one key per step")
    if not isinstance(m["files"].get(TENSORS), str):
        raise TrajectoryError(f"{where}: files has no sha256 for {TENSORS}")
    if not isinstance(m["side"].get("resumed_after_step", None), (int, type(None))):
        raise TrajectoryError(f"{where}: side.resumed_after_step must be an integer or null")


def check_tensors(traj: Trajectory) -> None:
    """Raise :class:`TrajectoryError` unless the stored tensors have the shapes the manifest implies.

    ``init_latents (N, T, C)`` with ``T = grid h·w``; ``sigmas (S+1,)`` FP32 equal to the manifest's
    table; ``prompt.i (L_i, D)`` for every sample and ``negative (L, D)``; and, when stored at all, all
    of ``v (S, N, T, C)``, ``x (S+1, N, T, C)`` and ``logp (S, N)``.
    """
    m, t = traj.manifest, traj.tensors
    where = traj.path or "artifact"
    S, N = len(m["steps"]), len(m["sample_ids"])
    T = m["grid"][0] * m["grid"][1]
    names = ["init_latents", "sigmas", "negative"] + [f"prompt.{i}" for i in range(N)]
    if "negatives" in m["prompt_hashes"]:  # one negative per prompt (edit prompts encoded with their images)
        names += [f"negative.{i}" for i in range(N)]
    missing = [n for n in names if n not in t]
    if missing:
        raise TrajectoryError(f"{where}: {TENSORS} is missing {', '.join(missing)}")
    x0 = t["init_latents"]
    if x0.dim() != 3 or tuple(x0.shape[:2]) != (N, T):
        raise TrajectoryError(f"{where}: init_latents has shape {tuple(x0.shape)}, expected ({N}, {T}, C)")
    C = x0.shape[2]
    if t["sigmas"].dtype != torch.float32 or tuple(t["sigmas"].shape) != (S + 1,):
        raise TrajectoryError(f"{where}: sigmas is {t['sigmas'].dtype} {tuple(t['sigmas'].shape)}, expected float32 ({S + 1},)")
    if [float(v) for v in t["sigmas"]] != [float(v) for v in m["sigma_table"]]:
        raise TrajectoryError(f"{where}: the manifest's sigma_table does not match the stored sigma tensor")
    D = t["negative"].shape[-1] if t["negative"].dim() == 2 else None
    for n in names[2:]:
        if t[n].dim() != 2 or t[n].shape[0] < 1 or t[n].shape[1] != D:
            raise TrajectoryError(f"{where}: {n} has shape {tuple(t[n].shape)}, expected (L >= 1, {D})")
    cond = m.get("conditioning")
    if cond:  # edit: each sample's input-image latents, (Σ h·w, C) on its recorded grid(s)
        from .conditioning import recorded_grids

        grids = cond.get("grids")
        if not isinstance(grids, list) or len(grids) != N or not isinstance(cond.get("sha256"), list) or len(cond["sha256"]) != N:
            raise TrajectoryError(f"{where}: conditioning must hold one grid and one sha256 per sample ({N})")
        for i, g in enumerate(grids):
            c = t.get(f"condition.{i}")
            if c is None:
                raise TrajectoryError(f"{where}: {TENSORS} is missing condition.{i} (the edit conditioning of sample {i})")
            rows = sum(h * w for h, w in recorded_grids(g))
            if c.dim() != 2 or tuple(c.shape) != (rows, C):
                raise TrajectoryError(f"{where}: condition.{i} has shape {tuple(c.shape)}, expected ({rows}, {C}) for grid {g}")
    stored = [k for k in ("v", "x", "logp") if k in t]
    if stored and len(stored) != 3:
        raise TrajectoryError(f"{where}: {TENSORS} holds {', '.join(stored)} but not all of v, x, logp")
    if stored:
        expected = {"v": (S, N, T, C), "x": (S + 1, N, T, C), "logp": (S, N)}
        for k, shape in expected.items():
            if tuple(t[k].shape) != shape:
                raise TrajectoryError(f"{where}: {k} has shape {tuple(t[k].shape)}, expected {shape}")


def verify_hashes(traj: Trajectory) -> None:
    """Check every stored tensor against the per-step hashes in the manifest."""
    m = traj.manifest
    if tensor_sha256(traj.tensors["sigmas"]) != m["sigma_sha256"]:
        raise TrajectoryError("sigma table does not match its hash in the manifest")
    if tensor_sha256(traj.tensors["init_latents"]) != m["init_latents_sha256"]:
        raise TrajectoryError("initial latents do not match their hash in the manifest")
    for i, h in enumerate((m.get("conditioning") or {}).get("sha256", [])):
        if tensor_sha256(traj.tensors[f"condition.{i}"]) != h:
            raise TrajectoryError(f"the edit conditioning of sample {i} does not match its hash in the manifest")
    if not traj.has_tensors():
        return
    for s, step in enumerate(m["steps"]):
        for what, key in (("v", "v"), ("x", "x"), ("logp", "logp")):
            tensor = traj.tensors[key][s + 1] if key == "x" else traj.tensors[key][s]
            for n, h in enumerate(step[what]):
                if tensor_sha256(tensor[n]) != h:
                    raise TrajectoryError(f"step {s} sample {m['sample_ids'][n]}: stored {what} does not match its hash")

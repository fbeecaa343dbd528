"""Stage keys: what a stage's result depends on, named by content rather than by path.

A stage's artifact, or a side's step checkpoint, is reused only when the key stored with it equals
the key of the current inputs, part by part:

    config          the settings the stage reads, key by key (``sampler.eta``: 0.7), so a mismatch
                    names the keys that changed: the rollout reads seed, model, prompts, sampler,
                    lora and rollout; the recompute reads seed, model, sampler, lora and recompute
                    (its prompts are the rollout's). A side's ``runtime`` is stored as resolved
                    (its own setting, else ``runtime.mode``). Nothing else (output_dir, resume,
                    progress, wandb, compare, extra, the other side) is part of a key.
    fingerprint     the architecture (the checkpoint's config.json or the preset)
    weights_sha256  the base weights as loaded: the checkpoint's contents, not its path
    lora_sha256     the LoRA adapter's tensors ("none" without an adapter)
    prompts_sha256  the prompt embeddings and the negative prompt
    conditioning_sha256  edit runs: each sample's input-image latents and grid ("none" for text-to-image;
                    the recompute's are the rollout's recorded ones)
    mmdit_strict    the package version
    code            sha256 of the package's own sources (every ``.py`` and ``.yaml`` file under
                    ``mmdit_strict/``) and the torch / Triton versions: the code that makes the bytes
    rollout         recompute only: sha256 of the rollout tensor file it replays

Retraining into the same checkpoint folder, re-exporting the prompt embeddings, pulling another
commit or editing a kernel therefore re-runs the stages, and :func:`describe_mismatch` says which
part changed (for ``config``, which keys).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .artifact import TENSORS, Trajectory

#: The sections (and top-level keys) each stage reads; its own side's ``runtime`` is stored resolved.
ROLLOUT_READS = ("seed", "model", "prompts", "sampler", "lora", "rollout")
RECOMPUTE_READS = ("seed", "model", "sampler", "lora", "recompute")

_MEANING = {
    "config": "the settings the stage reads differ",
    "fingerprint": "the model architecture differs",
    "weights_sha256": "the model weights differ (checkpoint contents or model settings)",
    "lora_sha256": "the LoRA adapter differs",
    "prompts_sha256": "the prompt embeddings differ",
    "conditioning_sha256": "the edit conditioning (input-image latents) differs",
    "mmdit_strict": "another mmdit_strict version made it",
    "code": "the mmdit_strict sources or the torch / Triton versions differ",
    "rollout": "the rollout it replays differs",
}


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def stage_settings(cfg: DictConfig, reads: tuple[str, ...], side: str) -> dict[str, Any]:
    """The keys of ``cfg`` under ``reads``, flattened (``sampler.eta``), with ``<side>.runtime`` resolved."""
    tree = OmegaConf.to_container(cfg, resolve=True)
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            out[prefix] = node

    for name in reads:
        walk(tree.get(name), name)  # type: ignore[union-attr]
    own = tree[side].get("runtime")  # type: ignore[index]
    out[f"{side}.runtime"] = own if own is not None else tree["runtime"]["mode"]  # type: ignore[index]
    return out


def _version() -> str:
    from .. import __version__

    return str(__version__)


@functools.lru_cache(maxsize=1)
def code_sha256() -> str:
    """sha256 over the package's sources (relative path and bytes of every ``.py`` / ``.yaml``, in path order)
    and the torch and Triton versions: what decides the bytes besides the inputs."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(f"torch {torch.__version__}\ntriton {triton_version}\n".encode())
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".yaml") and "__pycache__" not in p.parts):
        data = path.read_bytes()
        h.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _conditioning(prompt_hashes: dict[str, Any]) -> str:
    images = prompt_hashes.get("images")
    return "none" if images is None else _sha256_json(images)


def rollout_key(cfg: DictConfig, model_hashes: dict[str, str | None], prompt_hashes: dict[str, Any]) -> dict[str, Any]:
    """The rollout stage's key: its settings (not the recompute side's), architecture, weights, LoRA, prompts, version."""
    return {
        "config": stage_settings(cfg, ROLLOUT_READS, "rollout"),
        "fingerprint": str(model_hashes["fingerprint"]),
        "weights_sha256": str(model_hashes["weights_sha256"]),
        "lora_sha256": str(model_hashes["lora_sha256"] or "none"),
        "prompts_sha256": _sha256_json(prompt_hashes),
        "conditioning_sha256": _conditioning(prompt_hashes),
        "mmdit_strict": _version(),
        "code": code_sha256(),
    }


def recompute_key(cfg: DictConfig, model_hashes: dict[str, str | None], rollout: Trajectory) -> dict[str, Any]:
    """The recompute stage's key: its settings, architecture, weights, LoRA, the replayed prompts and rollout file, version."""
    return {
        "config": stage_settings(cfg, RECOMPUTE_READS, "recompute"),
        "fingerprint": str(model_hashes["fingerprint"]),
        "weights_sha256": str(model_hashes["weights_sha256"]),
        "lora_sha256": str(model_hashes["lora_sha256"] or "none"),
        "prompts_sha256": _sha256_json(rollout.manifest["prompt_hashes"]),
        "conditioning_sha256": _conditioning(rollout.manifest["prompt_hashes"]),
        "mmdit_strict": _version(),
        "code": code_sha256(),
        "rollout": str(rollout.manifest["files"][TENSORS]),
    }


def _settings_changes(stored: Any, current: Any) -> str:
    """``sampler.eta 0.7 → 0.5, rollout.batch_size 4 → 2`` (keys present on one side only: ``(absent)``)."""
    if not (isinstance(stored, dict) and isinstance(current, dict)):
        return "stored as a digest by an older mmdit_strict, so the keys cannot be named"
    absent = object()
    diffs = []
    for k in sorted(set(stored) | set(current)):
        a, b = stored.get(k, absent), current.get(k, absent)
        if a != b:
            diffs.append(f"{k} {'(absent)' if a is absent else repr(a)} → {'(absent)' if b is absent else repr(b)}")
    return ", ".join(diffs)


def describe_mismatch(stored: dict[str, Any] | None, current: dict[str, Any]) -> str:
    """One line naming every part of ``current`` that ``stored`` lacks or holds differently (for ``config``, the keys)."""
    if not stored:
        return "it was stored without a content key (an older mmdit_strict made it)"
    parts = []
    for name in sorted(set(stored) | set(current)):
        if stored.get(name) != current.get(name):
            if name == "config":
                detail = _settings_changes(stored.get(name), current.get(name))
            else:
                was, now = str(stored.get(name))[:12], str(current.get(name))[:12]
                detail = f"{was}… → {now}…"
            parts.append(f"{name} changed ({_MEANING.get(name, 'differs')}: {detail})")
    return "; ".join(parts) if parts else "no difference"

"""Stage keys: what a stage's result depends on, named by content rather than by path.

A stage's artifact, or a side's step checkpoint, is reused only when the key stored with it equals
the key of the current inputs, part by part:

    config          sha256 of the settings the stage reads (run-level keys such as output_dir,
                    resume, progress, wandb and compare are left out)
    fingerprint     the architecture (the checkpoint's config.json or the preset)
    weights_sha256  the base weights as loaded: the checkpoint's contents, not its path
    lora_sha256     the LoRA adapter's tensors ("none" without an adapter)
    prompts_sha256  the prompt embeddings and the negative prompt
    mmdit_strict    the package version
    code            sha256 of the package's own sources (every ``.py`` and ``.yaml`` file under
                    ``mmdit_strict/``) and the torch / Triton versions: the code that makes the bytes
    rollout         recompute only: sha256 of the rollout tensor file it replays

Retraining into the same checkpoint folder, re-exporting the prompt embeddings, pulling another
commit or editing a kernel therefore re-runs the stages, and :func:`describe_mismatch` says which
part changed.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .artifact import TENSORS, Trajectory

RUN_LEVEL = ("output_dir", "resume", "progress", "wandb", "compare", "distributed", "_choices_")

_MEANING = {
    "config": "the settings the stage reads differ",
    "fingerprint": "the model architecture differs",
    "weights_sha256": "the model weights differ (checkpoint contents or model settings)",
    "lora_sha256": "the LoRA adapter differs",
    "prompts_sha256": "the prompt embeddings differ",
    "mmdit_strict": "another mmdit_strict version made it",
    "code": "the mmdit_strict sources or the torch / Triton versions differ",
    "rollout": "the rollout it replays differs",
}


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def config_sha256(cfg: DictConfig, ignore: tuple[str, ...] = ()) -> str:
    """sha256 of the resolved config without the run-level keys and the top-level sections in ``ignore``."""
    skip = RUN_LEVEL + tuple(ignore)
    return _sha256_json({k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in skip})


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


def rollout_key(cfg: DictConfig, model_hashes: dict[str, str | None], prompt_hashes: dict[str, Any]) -> dict[str, str]:
    """The rollout stage's key: its settings (not the recompute side's), architecture, weights, LoRA, prompts, version."""
    return {
        "config": config_sha256(cfg, ignore=("recompute",)),
        "fingerprint": str(model_hashes["fingerprint"]),
        "weights_sha256": str(model_hashes["weights_sha256"]),
        "lora_sha256": str(model_hashes["lora_sha256"] or "none"),
        "prompts_sha256": _sha256_json(prompt_hashes),
        "mmdit_strict": _version(),
        "code": code_sha256(),
    }


def recompute_key(cfg: DictConfig, model_hashes: dict[str, str | None], rollout: Trajectory) -> dict[str, str]:
    """The recompute stage's key: its settings, architecture, weights, LoRA, the replayed prompts and rollout file, version."""
    return {
        "config": config_sha256(cfg),
        "fingerprint": str(model_hashes["fingerprint"]),
        "weights_sha256": str(model_hashes["weights_sha256"]),
        "lora_sha256": str(model_hashes["lora_sha256"] or "none"),
        "prompts_sha256": _sha256_json(rollout.manifest["prompt_hashes"]),
        "mmdit_strict": _version(),
        "code": code_sha256(),
        "rollout": str(rollout.manifest["files"][TENSORS]),
    }


def describe_mismatch(stored: dict[str, Any] | None, current: dict[str, str]) -> str:
    """One line naming every part of ``current`` that ``stored`` lacks or holds differently."""
    if not stored:
        return "it was stored without a content key (an older mmdit_strict made it)"
    parts = []
    for name in sorted(set(stored) | set(current)):
        if stored.get(name) != current.get(name):
            was, now = str(stored.get(name))[:12], str(current.get(name))[:12]
            parts.append(f"{name} changed ({_MEANING.get(name, 'differs')}: {was}… → {now}…)")
    return "; ".join(parts) if parts else "no difference"

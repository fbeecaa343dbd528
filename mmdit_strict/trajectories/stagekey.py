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
    rollout         recompute only: sha256 of the rollout tensor file it replays

Retraining into the same checkpoint folder or re-exporting the prompt embeddings therefore
re-runs the stages, and :func:`describe_mismatch` says which part changed.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .artifact import TENSORS, Trajectory

RUN_LEVEL = ("output_dir", "resume", "progress", "wandb", "compare", "_choices_")

_MEANING = {
    "config": "the settings the stage reads differ",
    "fingerprint": "the model architecture differs",
    "weights_sha256": "the model weights differ (checkpoint contents or model settings)",
    "lora_sha256": "the LoRA adapter differs",
    "prompts_sha256": "the prompt embeddings differ",
    "mmdit_strict": "another mmdit_strict version made it",
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


def rollout_key(cfg: DictConfig, model_hashes: dict[str, str | None], prompt_hashes: dict[str, Any]) -> dict[str, str]:
    """The rollout stage's key: its settings (not the recompute side's), architecture, weights, LoRA, prompts, version."""
    return {
        "config": config_sha256(cfg, ignore=("recompute",)),
        "fingerprint": str(model_hashes["fingerprint"]),
        "weights_sha256": str(model_hashes["weights_sha256"]),
        "lora_sha256": str(model_hashes["lora_sha256"] or "none"),
        "prompts_sha256": _sha256_json(prompt_hashes),
        "mmdit_strict": _version(),
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

"""Architecture/arithmetic fingerprint: one sha256 over everything two runs must share to be comparable."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .config.arch import ArchConfig, preset

# Pinned facts of the sampling / arithmetic contract (docs/design.md §2-3). Changing any of them changes
# every fingerprint, which is the point.
CONTRACT_PINS: dict[str, Any] = {
    "dtype_policy": {"execution_dtypes": ["bf16", "fp32"], "accumulator": "fp32", "tf32": False, "split_k": False,
                     "casts": "one cast to the storage dtype per operator, at its output"},
    "scheduler": {"sigmas": "linspace(1, 1/N, N)", "time_shift": "exponential", "base_seq_len": 256, "max_seq_len": 8192,
                  "base_shift": 0.5, "max_shift": 0.9, "shift_terminal": 0.02, "append_zero": True},
    "cfg": {"combine": "neg + s * (cond - neg)", "renorm": "per-token ||cond|| / ||comb|| over channels, pairwise tree"},
    "sde": {"kind": "flow-grpo", "eta_default": 0.7, "precision": "fp32", "logp": "mean over non-batch elements, pairwise tree"},
    "noise": {"generator": "torch cpu", "dtype": "fp32", "key": "sha256(seed, sample_id, step, purpose)"},
    "attention": {"layout": "packed varlen per sample, [text, image]", "mask": "prefix"},
}


def fingerprint(config: ArchConfig | str | None = None) -> str:
    """sha256 hex of the architecture, dtype policy, scheduler, CFG and SDE pins and package version."""
    from . import __version__

    if config is None:
        config = preset("qwen-image")
    elif isinstance(config, str):
        config = preset(config)
    payload = {"arch": config.to_dict(), "pins": CONTRACT_PINS, "version": __version__}
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()

"""A random-weight checkpoint in diffusers' layout, for timing loads without downloading Qwen-Image.

The model is built on the ``meta`` device, given storage in the stored dtype on ``device`` (the GPU for
the 60-block model: no FP32 host copy), drawn by :func:`mmdit_strict.model.init_weights` and written by
``MMDiT.save_pretrained`` in ``shards`` safetensors files. A folder that already holds a checkpoint of the
same description (``random_checkpoint.json``, which also records the hash of the written weights) is
reused as it is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config.arch import ArchConfig
from ..model import MMDiT, init_weights, state_dict_hash

STAMP = "random_checkpoint.json"


def shard_size(total_bytes: int, largest_bytes: int, shards: int) -> int:
    """A ``max_shard_size`` that makes the greedy writer produce at most ``shards`` files (exactly that many
    when the largest tensor is small beside a shard, as for Qwen-Image's 9 shards)."""
    return total_bytes // max(1, shards) + largest_bytes


def write_random_checkpoint(
    arch: ArchConfig, folder: str | Path, *, shards: int = 9, dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu", seed: int = 0,
) -> Path:
    """Write (or reuse) a random ``dtype`` checkpoint of ``arch`` in ``folder``; returns the folder.

    Deterministic in ``seed`` and the device type (CUDA draws differ from CPU draws, as in ``init_weights``).
    """
    folder = Path(folder)
    want = {"arch": arch.to_diffusers_config(), "shards": shards, "dtype": str(dtype), "device_type": torch.device(device).type,
            "seed": seed}
    if (found := read_stamp(folder)) is not None and {k: found.get(k) for k in want} == want:
        return folder
    with torch.device("meta"):
        model = MMDiT(arch)
    model = model.to(dtype=dtype).to_empty(device=torch.device(device))
    init_weights(model, seed)
    digest = state_dict_hash(model.state_dict())
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    model.save_pretrained(folder, max_shard_size=shard_size(sum(sizes), max(sizes), shards))
    del model
    (folder / STAMP).write_text(json.dumps({**want, "state_sha256": digest}, indent=2))
    return folder


def read_stamp(folder: str | Path) -> dict | None:
    """What :func:`write_random_checkpoint` recorded about the checkpoint in ``folder`` (its description and
    ``state_sha256``, the ``state_dict_hash`` of the model it wrote), or None for another checkpoint."""
    stamp = Path(folder) / STAMP
    try:
        return json.loads(stamp.read_text()) if stamp.is_file() else None
    except json.JSONDecodeError:
        return None

"""Export the trained LoRA: a PEFT adapter folder and diffusers' LoRA file.

* ``<dir>/peft/``: ``adapter_config.json`` (PEFT ``LoraConfig``) and ``adapter_model.safetensors``
  with PEFT's saved key names (``base_model.model.<module>.lora_A.weight``).
* ``<dir>/diffusers/pytorch_lora_weights.safetensors``: keys ``transformer.<module>.lora_A.weight``
  and the adapter config in the file's ``lora_adapter_metadata`` (``transformer.``-prefixed, as
  diffusers' pipeline-level ``save_lora_weights`` writes it), which ``load_lora_adapter(folder)`` of
  ``QwenImageTransformer2DModel`` or ``MMDiT`` and ``QwenImagePipeline.load_lora_weights`` read.
  Module names are diffusers' (our parameter tree uses them).

The same adapter always gives the same bytes in every file (sorted JSON, sorted safetensors header).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..io import atomic_write, atomic_write_text, save_safetensors

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
DIFFUSERS_WEIGHTS = "pytorch_lora_weights.safetensors"


def lora_tensors(model: torch.nn.Module, adapter: str = "default") -> dict[str, torch.Tensor]:
    """``{"<module>.lora_A.weight": (r, in), "<module>.lora_B.weight": (out, r)}`` of one adapter (CPU copies)."""
    out = {}
    for name, p in model.named_parameters():
        for kind in ("lora_A", "lora_B"):
            tag = f".{kind}.{adapter}.weight"
            if name.endswith(tag):
                out[name[: -len(tag)] + f".{kind}.weight"] = p.detach().to("cpu").contiguous().clone()
    if not out:
        raise ValueError(f"the model has no LoRA adapter named {adapter!r} to export")
    return out


def adapter_config(rank: int, alpha: float, targets: list[str]) -> dict:
    """The PEFT ``LoraConfig`` of our adapter as a plain dict (no dropout, no bias, unmerged)."""
    from peft import LoraConfig

    cfg = LoraConfig(r=int(rank), lora_alpha=float(alpha), target_modules=list(targets), lora_dropout=0.0)
    d = cfg.to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in d.items()}


def export_lora(model: torch.nn.Module, out_dir: str | Path, rank: int, alpha: float, targets: list[str]) -> dict[str, Path]:
    """Write both formats under ``out_dir`` (each file atomically; byte-identical for the same adapter).

    Returns ``{"peft": dir, "diffusers": dir}``.
    """
    out_dir = Path(out_dir)
    tensors = lora_tensors(model)
    config = adapter_config(rank, alpha, targets)
    peft_dir, diff_dir = out_dir / "peft", out_dir / "diffusers"
    peft_sd = {f"base_model.model.{k}": v for k, v in tensors.items()}
    atomic_write(peft_dir / PEFT_WEIGHTS, lambda p: save_safetensors(peft_sd, p, metadata={"format": "pt"}))
    atomic_write_text(peft_dir / PEFT_CONFIG, json.dumps(config, indent=2, sort_keys=True, default=str))
    diff_sd = {f"transformer.{k}": v for k, v in tensors.items()}
    meta = {"format": "pt", "lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()},
                                                                 indent=2, sort_keys=True, default=str)}
    atomic_write(diff_dir / DIFFUSERS_WEIGHTS, lambda p: save_safetensors(diff_sd, p, metadata=meta))
    return {"peft": peft_dir, "diffusers": diff_dir}

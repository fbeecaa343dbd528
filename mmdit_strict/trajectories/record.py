"""Collects one side's per-step tensors and builds its artifact manifest."""

from __future__ import annotations

import time
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from ..fingerprint import fingerprint
from ..kernels.runtime import Runtime
from ..kernels.trace import OperatorTrace
from ..model import MMDiT, state_dict_hash
from ..sampling import noise_key
from .artifact import Trajectory, hardware_info, software_info
from .hashing import tensor_sha256
from .setup import Prompts, base_state, lora_state


class StepRecorder:
    """Holds v_t, x_{t+1}, logp_t for every (step, sample) of one side, indexed by sample position."""

    def __init__(self, num_steps: int, x0: torch.Tensor) -> None:
        N = x0.shape[0]
        self.x = torch.empty((num_steps + 1,) + tuple(x0.shape), dtype=torch.float32)
        self.x[0] = x0.detach().cpu()
        self.v = torch.empty((num_steps,) + tuple(x0.shape), dtype=torch.float32)
        self.logp = torch.empty(num_steps, N, dtype=torch.float32)
        self.blocks: list[list[list[str] | None]] = [[None] * N for _ in range(num_steps)]

    def put(self, step: int, rows: list[int], v: torch.Tensor, x_next: torch.Tensor, logp: torch.Tensor,
            block_hashes: list[list[str]] | None = None) -> None:
        if block_hashes:
            for r, h in zip(rows, block_hashes):
                self.blocks[step][r] = h
        idx = torch.tensor(rows)
        self.v[step, idx] = v.detach().float().cpu()
        self.x[step + 1, idx] = x_next.detach().float().cpu()
        self.logp[step, idx] = logp.detach().float().cpu()


def audit_summary(model: MMDiT) -> dict[str, Any] | None:
    """runtime=audit: how far the production path drifted from strict over all forwards of this side."""
    recs = model.audit_records
    if not recs:
        return None
    per_block = [
        {s: max(r["per_block"][i][s] for r in recs) for s in ("img", "txt")} for i in range(len(recs[0]["per_block"]))
    ]
    return {"forwards": len(recs), "byte_equal_forwards": sum(bool(r["byte_equal"]) for r in recs),
            "max_abs_drift": max(r["max_abs_drift"] for r in recs), "per_block_max_abs": per_block}


def model_hashes(model: MMDiT) -> dict[str, str | None]:
    """What identifies a side's policy by content: architecture fingerprint, base weights, LoRA (None without one)."""
    lora = lora_state(model)
    return {"fingerprint": fingerprint(model.config), "weights_sha256": state_dict_hash(base_state(model)),
            "lora_sha256": state_dict_hash(lora) if lora else None}


def build_trajectory(
    kind: str, cfg: DictConfig, model: MMDiT, runtime: Runtime, prompts: Prompts, sigmas: torch.Tensor,
    sample_ids: list[int], grid: tuple[int, int], rec: StepRecorder, trace: OperatorTrace, wall_s: float,
    side: dict[str, Any], save_tensors: bool, *, hashes: dict[str, str | None] | None = None,
    stage_key: dict[str, Any] | None = None,
) -> Trajectory:
    """The side's artifact in memory; ``hashes`` (weights/LoRA) are computed from ``model`` when not given."""
    S = sigmas.shape[0] - 1
    steps = []
    for s in range(S):
        steps.append({
            "step": s,
            "sigma": float(sigmas[s]),
            "sigma_prev": float(sigmas[s + 1]),
            "v": [tensor_sha256(rec.v[s, n]) for n in range(len(sample_ids))],
            "x": [tensor_sha256(rec.x[s + 1, n]) for n in range(len(sample_ids))],
            "logp": [tensor_sha256(rec.logp[s, n]) for n in range(len(sample_ids))],
            "logp_values": [float(v) for v in rec.logp[s]],
        })
        if any(h is not None for h in rec.blocks[s]):
            steps[-1]["blocks"] = rec.blocks[s]  # audit mode: per sample, per block image-stream hashes
    tensors: dict[str, torch.Tensor] = {
        "init_latents": rec.x[0].clone(),
        "sigmas": sigmas.detach().cpu().clone(),
        "negative": prompts.negative.detach().cpu().clone(),
    }
    for i, e in enumerate(prompts.embeds):
        tensors[f"prompt.{i}"] = e.detach().cpu().clone()
    for i, e in enumerate(prompts.negatives or []):  # edit: each prompt's negative, encoded with its images
        tensors[f"negative.{i}"] = e.detach().cpu().clone()
    conditioning = None
    if prompts.images is not None:  # edit: each sample's input-image latents (all its images), the replay input of both sides
        for i, im in enumerate(prompts.images):
            tensors[f"condition.{i}"] = im.latents.detach().to("cpu", torch.float32).clone()
        hashed = prompts.hashes()["images"]
        conditioning = {"grids": [h["grid"] for h in hashed], "sha256": [h["sha256"] for h in hashed],
                        "tokens": [im.tokens for im in prompts.images]}
        if any("images" in h for h in hashed):  # several input images per sample: each image's grid and sha256
            conditioning["images"] = [h.get("images", [{"grid": h["grid"], "sha256": h["sha256"]}]) for h in hashed]
    if save_tensors:
        tensors.update({"v": rec.v, "x": rec.x, "logp": rec.logp})
    manifest = {
        "kind": kind,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "fingerprint": fingerprint(model.config),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "runtime": runtime.value,
        "side": side,
        **(hashes if hashes is not None else model_hashes(model)),
        "stage_key": stage_key,
        "prompt_hashes": prompts.hashes(),
        "conditioning": conditioning,
        "sample_ids": sample_ids,
        "grid": list(grid),
        "sigma_table": [float(v) for v in sigmas],
        "sigma_sha256": tensor_sha256(tensors["sigmas"]),
        "init_latents_sha256": tensor_sha256(tensors["init_latents"]),
        "cfg_scale": float(cfg.sampler.cfg_scale),
        "eta": float(cfg.sampler.eta),
        "sde": bool(cfg.sampler.sde),
        "noise": {
            "seed": int(cfg.seed),
            "generator": "torch.Generator(cpu).manual_seed(key); torch.randn float32",
            "keys": {str(i): [noise_key(int(cfg.seed), i, s, "sde") for s in range(S)] for i in sample_ids},
            "initial_keys": {str(i): noise_key(int(cfg.seed), i, 0, "initial_latents") for i in sample_ids},
        },
        "trace": trace.summary(),
        "audit": audit_summary(model),
        "software": software_info(),
        "hardware": hardware_info(str(model.device)),
        "wall_seconds": round(wall_s, 3),
        "steps": steps,
    }
    return Trajectory(manifest, tensors)

"""Checks on a composed config that need more than a type: ranges, bounds, and values that only
make sense together. :func:`problems` runs at compose time on whichever command's schema was
composed (the sections present decide which checks apply), so a bad value is refused before any
model is built or any file is written.

Bounds exist where a value could exhaust the machine or make a run meaningless:

* ``sampler.num_steps`` ≤ 1000 (Flow-GRPO uses 10–50; every step keeps v and x for every sample);
* ``sampler.height``/``width`` ≤ 4096 pixels (65 536 image tokens; the reference shapes reach 1664);
* ``prompts.num_prompts`` ≤ 4096, prompt and ``pad_to`` lengths ≤ 4096 tokens;
* ``model.preset=qwen-image`` on a CPU (a 20 B-parameter model) only with ``model.allow_large_cpu=true``.

``train`` adds its own: a LoRA to train, positive counts and frequencies, an SDE noise level, a
learning rate, an EMA decay in [0, 1), an SDE window that fits the steps, and rewards that resolve.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .arch import preset

MAX_STEPS = 1000
MAX_PIXELS = 4096
MAX_PROMPTS = 4096
MAX_TOKENS = 4096
_FAULT = re.compile(r"^(?P<key>[A-Za-z0-9_.]+)(?:#(?P<row>\d+))?(?:@(?P<step>\d+))?$")
_FAULT_BLOCK = re.compile(r"^block(\d+)\.")


def _get(cfg: DictConfig, key: str) -> Any:
    return OmegaConf.select(cfg, key, default=None)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def problems(cfg: DictConfig) -> list[str]:
    """Every problem with ``cfg`` as one sentence naming the key; empty when the config is usable."""
    out: list[str] = []
    if not str(_get(cfg, "output_dir") or "").strip():
        out.append("output_dir must name a folder (it is empty)")

    steps = _get(cfg, "sampler.num_steps")
    if not _is_int(steps) or not 1 <= steps <= MAX_STEPS:
        out.append(f"sampler.num_steps must be between 1 and {MAX_STEPS}, got {steps}")
    preset_name = _get(cfg, "model.preset")
    try:
        arch = preset(preset_name)
    except (KeyError, ValueError):
        arch = None
    unit = 8 * arch.patch_size if arch is not None else 16
    for side in ("height", "width"):
        v = _get(cfg, f"sampler.{side}")
        if not _is_int(v) or v < unit or v % unit:
            out.append(f"sampler.{side} must be a positive multiple of {unit} pixels, got {v}")
        elif v > MAX_PIXELS:
            out.append(f"sampler.{side}={v} exceeds {MAX_PIXELS} pixels")
    for key in ("sampler.cfg_scale", "sampler.eta"):
        if not math.isfinite(float(_get(cfg, key))):
            out.append(f"{key} must be a finite number, got {_get(cfg, key)}")
    if _get(cfg, "sampler.sde") and not float(_get(cfg, "sampler.eta")) > 0:
        out.append(f"sampler.eta must be > 0 with the SDE sampler (logp needs a noise level), got {_get(cfg, 'sampler.eta')}")

    if preset_name == "qwen-image" and str(_get(cfg, "model.device")).startswith("cpu") and not _get(cfg, "model.allow_large_cpu"):
        out.append("model.preset=qwen-image on model.device=cpu builds a 20 B-parameter model (about 80 GB in float32); "
                   "use model=qwen-image on a GPU, model=tiny, or set model.allow_large_cpu=true")
    layers = _get(cfg, "model.num_layers")
    if layers is not None and (not _is_int(layers) or layers < 1):
        out.append(f"model.num_layers must be >= 1 (or null for the preset's), got {layers}")

    n = _get(cfg, "prompts.num_prompts")
    if not _is_int(n) or not 1 <= n <= MAX_PROMPTS:
        out.append(f"prompts.num_prompts must be between 1 and {MAX_PROMPTS}, got {n}")
    lo, hi, neg = (_get(cfg, f"prompts.{k}") for k in ("min_tokens", "max_tokens", "negative_tokens"))
    if not (_is_int(lo) and _is_int(hi) and 1 <= lo <= hi <= MAX_TOKENS):
        out.append(f"prompts.min_tokens and prompts.max_tokens need 1 <= min_tokens <= max_tokens <= {MAX_TOKENS}, got {lo}, {hi}")
    if not _is_int(neg) or not 1 <= neg <= MAX_TOKENS:
        out.append(f"prompts.negative_tokens must be between 1 and {MAX_TOKENS}, got {neg}")
    embeddings = _get(cfg, "prompts.embeddings")
    if embeddings and not Path(embeddings).is_file():
        out.append(f"prompts.embeddings={embeddings} is not a file")

    if "rollout" in cfg:
        out += _trajectory_problems(cfg, embeddings, hi, neg)
    rank = _get(cfg, "lora.rank")
    if not _is_int(rank) or rank < 0:
        out.append(f"lora.rank must be >= 0 (0 means no LoRA), got {rank}")
    elif rank > 0:
        alpha = float(_get(cfg, "lora.alpha"))
        if not (math.isfinite(alpha) and alpha > 0):
            out.append(f"lora.alpha must be a finite number > 0, got {alpha}")
        if not _get(cfg, "lora.targets"):
            out.append("lora.targets must name at least one module when lora.rank > 0")

    if "recompute" in cfg:
        out += _fault_problems(cfg, steps, arch)
    if "train" in cfg:
        out += _train_problems(cfg)
    return out


def _trajectory_problems(cfg: DictConfig, embeddings: Any, hi: Any, neg: Any) -> list[str]:
    """The rollout and recompute sides' batch sizes and padding."""
    out: list[str] = []
    for key in ("rollout.batch_size", "recompute.micro_batch"):
        v = _get(cfg, key)
        if not _is_int(v) or v < 1:
            out.append(f"{key} must be >= 1, got {v}")
    synthetic = not embeddings and not _get(cfg, "prompts.text")  # lengths known only for synthetic prompts
    for side in ("rollout", "recompute"):
        pad = _get(cfg, f"{side}.pad_to")
        if pad is None:
            continue
        if not _is_int(pad) or not 1 <= pad <= MAX_TOKENS:
            out.append(f"{side}.pad_to must be null or between 1 and {MAX_TOKENS}, got {pad}")
        elif synthetic and _is_int(hi) and pad < hi:
            out.append(f"{side}.pad_to={pad} is shorter than prompts.max_tokens={hi} (a prompt may be that long)")
        elif synthetic and _is_int(neg) and float(_get(cfg, "sampler.cfg_scale")) != 1.0 and pad < neg:
            out.append(f"{side}.pad_to={pad} is shorter than prompts.negative_tokens={neg}")
    timeout = _get(cfg, "distributed.timeout_s")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400):
        out.append(f"distributed.timeout_s must be between 0 and 86400 seconds (exclusive of 0), got {timeout}")
    return out


def _train_problems(cfg: DictConfig) -> list[str]:
    """``train``'s sections: what the trainer, optimizer, EMA, SDE window and rewards need."""
    out: list[str] = []
    rank = _get(cfg, "lora.rank")
    if _is_int(rank) and rank == 0:
        out.append("train needs a LoRA adapter: set lora.rank > 0")
    if not _get(cfg, "sampler.sde"):
        out.append("sampler.sde must be true for train (GRPO samples with the SDE and trains on its logp)")
    for key in ("train.num_epochs", "train.num_inner_epochs", "train.micro_batch", "train.gradient_accumulation_steps",
                "train.save_freq", "train.eval_num_prompts", "sample.num_steps", "sample.num_image_per_prompt",
                "sample.prompts_per_epoch", "sample.batch_size"):
        v = _get(cfg, key)
        if not _is_int(v) or v < 1:
            out.append(f"{key} must be >= 1, got {v}")
    for key in ("train.eval_freq", "train.lr_warmup_steps", "sample.sde_window_size"):
        v = _get(cfg, key)
        if not _is_int(v) or v < 0:
            out.append(f"{key} must be >= 0, got {v}")
    for key in ("train.beta", "train.max_grad_norm", "train.clip_range", "train.adv_clip_max", "train.adam_weight_decay",
                "train.adam_epsilon"):
        v = float(_get(cfg, key))
        if not (math.isfinite(v) and v >= 0):
            out.append(f"{key} must be a finite number >= 0, got {v}")
    for key in ("train.learning_rate", "sample.noise_level"):
        v = float(_get(cfg, key))
        if not (math.isfinite(v) and v > 0):
            what = " (the SDE needs noise)" if key == "sample.noise_level" else ""
            out.append(f"{key} must be a finite number > 0{what}, got {v}")
    if not math.isfinite(float(_get(cfg, "sample.guidance_scale"))):
        out.append(f"sample.guidance_scale must be a finite number, got {_get(cfg, 'sample.guidance_scale')}")
    for key in ("train.adam_beta1", "train.adam_beta2", "train.ema_decay"):
        v = float(_get(cfg, key))
        if not 0.0 <= v < 1.0:
            out.append(f"{key} must be in [0, 1), got {v}")
    frac = float(_get(cfg, "train.timestep_fraction"))
    if not 0.0 < frac <= 1.0:
        out.append(f"train.timestep_fraction must be in (0, 1], got {frac}")
    ahead = _get(cfg, "train.park_lookahead")
    if ahead is not None and (not _is_int(ahead) or ahead < 0):
        out.append(f"train.park_lookahead must be null or >= 0 keys, got {ahead}")
    threads = _get(cfg, "train.cpu_threads")
    if threads is not None and (not _is_int(threads) or threads < 1):
        out.append(f"train.cpu_threads must be null or >= 1, got {threads}")
    out += _window_problems(cfg)
    return out


def _window_problems(cfg: DictConfig) -> list[str]:
    size, steps, rng = (_get(cfg, k) for k in ("sample.sde_window_size", "sample.num_steps", "sample.sde_window_range"))
    if rng is None or not (_is_int(size) and _is_int(steps)) or size <= 0 or size >= steps:
        return []
    bounds = list(rng)
    if not (len(bounds) == 2 and all(_is_int(b) for b in bounds)
            and 0 <= bounds[0] < bounds[1] <= steps and bounds[1] - bounds[0] >= size):
        return [f"sample.sde_window_range must be [lo, hi) with 0 <= lo < hi <= sample.num_steps={steps} and "
                f"hi - lo >= sample.sde_window_size={size}, got {bounds}"]
    return []


def _fault_problems(cfg: DictConfig, steps: Any, arch: Any) -> list[str]:
    spec = _get(cfg, "recompute.inject_fault")
    if spec is None:
        return []
    m = _FAULT.match(str(spec))
    if not m:
        return [f"recompute.inject_fault must look like 'block1.img.mlp_down_gemm@2' (or with a row, "
                f"'block1.img.mlp_down_gemm#70@2'), got {spec!r}"]
    out = []
    step = int(m.group("step") or 0)
    if _is_int(steps) and step >= steps:
        out.append(f"recompute.inject_fault={spec!r} names step {step} but sampler.num_steps={steps}")
    layers = _get(cfg, "model.num_layers")
    if layers is None and _get(cfg, "model.checkpoint") is None and arch is not None:
        layers = arch.num_layers
    block = _FAULT_BLOCK.match(m.group("key"))
    if block and _is_int(layers) and int(block.group(1)) >= layers:
        out.append(f"recompute.inject_fault={spec!r} names block {block.group(1)} but the model has {layers} blocks")
    # runtime=off runs the same operator calls (production implementations, same keys), so a fault lands there too
    return out


"""Build what a run side needs from its config sections: model (+ LoRA), prompts, schedule.

Each builder takes the typed sections it reads (:mod:`mmdit_strict.config.schema`; a composed
DictConfig section or the dataclass itself), not the whole config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from omegaconf import DictConfig

from ..dtypes import BY_CONFIG_NAME as DTYPES
from ..config.arch import ArchConfig, preset
from ..config.schema import LoraConfig, ModelConfig, PromptsConfig, SamplerConfig
from ..kernels.runtime import Runtime
from ..model import MMDiT, build_model
from ..model.edit import SampleConditioning
from ..sampling import sigma_table
from .hashing import tensor_sha256



@dataclass
class Prompts:
    """Pre-encoded prompts: per-prompt valid rows (no padding), plus the shared negative prompt, and for an
    edit run each sample's input image(s) (packed latents, FP32 on the CPU).

    ``negatives`` (edit prompts encoded with a vision tower): each prompt's own negative, encoded with that
    prompt's images as the diffusers edit pipelines do; ``negative`` then holds prompt 0's."""

    embeds: list[torch.Tensor]  # each (L_i, C)
    negative: torch.Tensor  # (L_neg, C)
    images: list[SampleConditioning] | None = None  # edit conditioning (one or several images) per prompt; None: text-to-image
    negatives: list[torch.Tensor] | None = None  # per-prompt negatives, each (L_neg_i, C); None: ``negative`` shared

    def hashes(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prompts": [tensor_sha256(e) for e in self.embeds], "negative": tensor_sha256(self.negative)}
        if self.images is not None:
            from .conditioning import image_hashes

            out["images"] = image_hashes(self.images)
        if self.negatives is not None:
            out["negatives"] = [tensor_sha256(e) for e in self.negatives]
        return out

    def negatives_of(self, rows: list[int]) -> torch.Tensor | list[torch.Tensor]:
        """The negative prompt of prompts ``rows``: the shared one, or each prompt's own (a list)."""
        return self.negative if self.negatives is None else [self.negatives[i] for i in rows]

    def negative_list(self, rows: list[int]) -> list[torch.Tensor]:
        """One negative per row of ``rows`` (the shared one repeated, or each prompt's own)."""
        return [self.negative] * len(rows) if self.negatives is None else [self.negatives[i] for i in rows]

    def images_of(self, rows: list[int]) -> list[SampleConditioning] | None:
        """The conditioning images of prompts ``rows`` (None for text-to-image): the main job's sample ``i`` is
        prompt ``i``; a GRPO group's samples all take their prompt's image."""
        return None if self.images is None else [self.images[i] for i in rows]


def resolve_runtime(value: str | None, mode: str) -> Runtime:
    """A side's runtime: its own setting (``rollout.runtime``, ``train.runtime``, ...), else ``runtime.mode``."""
    return Runtime.parse(value if value is not None else mode)


def side_runtime(cfg: DictConfig, side: str) -> Runtime:
    """The runtime of section ``side`` (``rollout`` or ``recompute``) of a trajectory config."""
    return resolve_runtime(cfg[side].runtime, cfg.runtime.mode)


def arch_from_config(model: ModelConfig) -> ArchConfig:
    """The preset's architecture, with ``model.num_layers`` applied when set."""
    arch = preset(model.preset)
    if model.num_layers is not None:
        arch = dataclasses.replace(arch, num_layers=model.num_layers)
    return arch


def check_device(device: str) -> None:
    """A clear error for a device this machine does not have."""
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"model.device={device!r} is not a torch device: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device={device} but this machine has no CUDA device (use model.device=cpu)")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"model.device={device}: only cpu and cuda are supported")


def build_side_model(mcfg: ModelConfig, lcfg: LoraConfig, runtime: Runtime) -> MMDiT:
    """The model one side runs: checkpoint or deterministic init, then the policy's LoRA (``lcfg.rank`` > 0)."""
    dtype = DTYPES[mcfg.dtype]
    check_device(mcfg.device)
    if mcfg.checkpoint:
        model = MMDiT.from_pretrained(mcfg.checkpoint, runtime=runtime, dtype=dtype, device=mcfg.device)
    else:
        model = build_model(arch_from_config(mcfg), seed=mcfg.init_seed, runtime=runtime.value, dtype=dtype, device=mcfg.device)
    if lcfg.rank > 0:
        attach_lora(model, lcfg)
    if getattr(mcfg, "cuda_graphs", True) and torch.device(mcfg.device).type == "cuda":
        model.enable_cuda_graphs()  # used by no-grad strict/auto forwards only (rollout); same bytes as eager
    model.requires_grad_(False)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.requires_grad_(True)
    return model


def attach_lora(model: MMDiT, lcfg: LoraConfig) -> MMDiT:
    """Inject a PEFT LoRA adapter (unmerged) and initialise it deterministically from ``lcfg.seed``."""
    from peft import LoraConfig as PeftLoraConfig, inject_adapter_in_model

    config = PeftLoraConfig(r=lcfg.rank, lora_alpha=float(lcfg.alpha), target_modules=list(lcfg.targets), lora_dropout=0.0)
    inject_adapter_in_model(config, model)
    gen = torch.Generator().manual_seed(lcfg.seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_A" in name:
                p.copy_((torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5).to(p.dtype))
            elif "lora_B" in name:
                val = 0.05 * torch.randn(p.shape, generator=gen) if lcfg.init == "random" else torch.zeros(p.shape)
                p.copy_(val.to(p.dtype))
    return model


def lora_state(model: MMDiT) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "lora_" in k}


def base_state(model: MMDiT) -> dict[str, torch.Tensor]:
    return {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k}


def make_prompts(p: PromptsConfig, arch: ArchConfig, device: str, dtype: str) -> Prompts:
    """Load prompt embeddings from safetensors, or draw synthetic ones keyed by (``p.seed``, prompt id); ``dtype`` is ``model.dtype``."""
    negatives: list[torch.Tensor] | None = None
    if p.embeddings:
        from safetensors.torch import load_file

        data = load_file(p.embeddings)
        for key in ("prompt_embeds", "prompt_mask", "negative_embeds"):
            if key not in data:
                raise ValueError(f"{p.embeddings} must hold prompt_embeds (N, L, C), prompt_mask (N, L) and negative_embeds "
                                 f"(L, C; or (N, L, C) with negative_mask (N, L): one negative per prompt); missing {key}")
        pe, pm = data["prompt_embeds"], data["prompt_mask"]
        if pe.dim() != 3 or pe.shape[0] < 1 or tuple(pm.shape) != tuple(pe.shape[:2]):
            raise ValueError(f"{p.embeddings}: prompt_embeds must be (N >= 1, L, C) with prompt_mask (N, L), "
                             f"got {tuple(pe.shape)} and {tuple(pm.shape)}")
        embeds = [pe[i, : int(pm[i].sum())] for i in range(pe.shape[0])]
        if any(e.shape[0] < 1 for e in embeds):
            raise ValueError(f"{p.embeddings}: every prompt needs at least one valid token (a prompt_mask row is all zero)")
        neg = data["negative_embeds"]
        if neg.dim() == 3:
            negatives = per_prompt_negatives(p.embeddings, neg, data.get("negative_mask"), len(embeds))
            neg = negatives[0]
    else:
        if not 1 <= p.min_tokens <= p.max_tokens:
            raise ValueError(f"prompts need 1 <= min_tokens <= max_tokens, got {p.min_tokens}, {p.max_tokens}")
        embeds = []
        for i in range(p.num_prompts):
            g = torch.Generator().manual_seed(1_000_003 * (p.seed + 1) + i)
            n = int(torch.randint(p.min_tokens, p.max_tokens + 1, (1,), generator=g))
            embeds.append(torch.randn(n, arch.joint_attention_dim, generator=g))
        g = torch.Generator().manual_seed(7_777_777 + p.seed)
        neg = torch.randn(p.negative_tokens, arch.joint_attention_dim, generator=g)
    torch_dtype = DTYPES[dtype]
    for e in embeds + [neg] + (negatives or []):
        if e.dim() != 2 or e.shape[1] != arch.joint_attention_dim:
            raise ValueError(f"prompt embeddings must be (L, {arch.joint_attention_dim}), got {tuple(e.shape)}")
        if not torch.isfinite(e).all():
            raise ValueError("prompt embeddings contain NaN or Inf")
    from .conditioning import make_images

    edit = getattr(p, "edit", None)
    images = make_images(edit, len(embeds), arch) if edit is not None else None
    cast = [e.to(device=device, dtype=torch_dtype) for e in negatives] if negatives is not None else None
    return Prompts([e.to(device=device, dtype=torch_dtype) for e in embeds], neg.to(device=device, dtype=torch_dtype), images,
                   cast)


def per_prompt_negatives(where: str, neg: torch.Tensor, mask: torch.Tensor | None, n: int) -> list[torch.Tensor]:
    """The valid rows of each prompt's negative in a prompt file's ``negative_embeds`` ``(N, L, C)`` and
    ``negative_mask`` ``(N, L)``; a clear error when the mask is missing or the counts disagree."""
    if mask is None or tuple(mask.shape) != tuple(neg.shape[:2]):
        raise ValueError(f"{where}: per-prompt negative_embeds {tuple(neg.shape)} need negative_mask (N, L) of the same N, L")
    if neg.shape[0] != n:
        raise ValueError(f"{where}: {neg.shape[0]} per-prompt negatives for {n} prompts (one per prompt)")
    rows = [neg[i, : int(mask[i].sum())] for i in range(n)]
    if any(r.shape[0] < 1 for r in rows):
        raise ValueError(f"{where}: every negative prompt needs at least one valid token (a negative_mask row is all zero)")
    return rows


def check_pad_to(name: str, pad_to: int | None, prompts: Prompts, cfg_scale: float) -> None:
    """A clear error when ``<name>.pad_to`` is shorter than a prompt (or the negative prompt, with CFG)."""
    if pad_to is None:
        return
    longest = max(e.shape[0] for e in prompts.embeds)
    if cfg_scale != 1.0:
        longest = max([longest, prompts.negative.shape[0]] + [e.shape[0] for e in prompts.negatives or []])
    if pad_to < longest:
        raise ValueError(f"{name}.pad_to={pad_to} is shorter than the longest prompt ({longest} tokens)")


def latent_grid(sampler: SamplerConfig, arch: ArchConfig) -> tuple[int, int]:
    """(h, w) tokens of the packed latent grid: pixels / (VAE 8 × patch)."""
    unit = 8 * arch.patch_size
    if sampler.height % unit or sampler.width % unit:
        raise ValueError(f"sampler.height and sampler.width must be multiples of {unit}, got {sampler.height}×{sampler.width}")
    return sampler.height // unit, sampler.width // unit


def schedule(sampler: SamplerConfig, arch: ArchConfig) -> torch.Tensor:
    """The sigma table of ``sampler.num_steps`` steps at this image size."""
    h, w = latent_grid(sampler, arch)
    return sigma_table(sampler.num_steps, h * w)

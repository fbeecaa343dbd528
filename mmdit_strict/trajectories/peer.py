"""The peer's rollout: the same sampling run with diffusers' transformer, eager, on the same weights.

Timing the rollout alone says little; the number users compare against is what they run today. This
loop does what ``QwenImagePipeline`` does per step — one forward over the batch's prompts, one over
the negative prompt (true CFG, two forwards), norm-rescaled CFG combine — then the same Flow-GRPO
SDE step and keyed noise as our rollout, over the same batches, initial latents and schedule. It
shares the rollout model's parameter storage (:func:`~mmdit_strict.model.diffusers_compat.diffusers_twin`)
and runs under PyTorch's default math settings (cuDNN / flash attention, as diffusers users run it).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from ..model import MMDiT
from ..model.diffusers_compat import diffusers_twin
from ..sampling import cfg_combine, initial_latents
from .engine import pad_prompts
from .rollout import rollout_batches, step_latents
from .setup import Prompts, latent_grid, schedule


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peer_rollout(cfg: DictConfig, model: MMDiT, prompts: Prompts, progress: bool = True) -> dict[str, Any]:
    """Run the rollout's sampling with diffusers' eager transformer; return wall and per-step seconds.

    One untimed forward per batch layout runs first (``warmup_seconds``), as the run's compile phase
    does for our rollout.
    The returned ``x_final`` (FP32, CPU) is the peer's last latents, for a parity figure against ours.
    """
    arch = model.config
    device = next(model.parameters()).device
    twin = diffusers_twin(model)
    grid = latent_grid(cfg.sampler, arch)
    sigmas = schedule(cfg.sampler, arch)
    S = sigmas.shape[0] - 1
    ids = list(range(len(prompts.embeds)))
    bs = int(cfg.rollout.batch_size)
    batches = rollout_batches(cfg.rollout.batch_size, len(ids))
    x = initial_latents(int(cfg.seed), ids, (grid[0] * grid[1], arch.in_channels), str(device))
    scale = float(cfg.sampler.cfg_scale)
    padded = {tuple(b): (pad_prompts([prompts.embeds[i] for i in b]), pad_prompts(prompts.negative_list(list(b))))
              for b in batches}

    def forward(xb: torch.Tensor, sigma: float, ehs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n = xb.shape[0]
        t = torch.full((n,), sigma, dtype=model.dtype, device=device)  # the pipeline's timestep / 1000
        return twin(hidden_states=xb.to(model.dtype), encoder_hidden_states=ehs, encoder_hidden_states_mask=mask,
                    timestep=t, img_shapes=[[(1, grid[0], grid[1])]] * n, return_dict=False)[0].float()

    # like our rollout after its compile phase, the peer is timed after one untimed step per batch layout
    # (cuDNN / cuBLAS heuristics, allocator warm-up)
    tw = time.perf_counter()
    with torch.no_grad():
        for batch in batches:
            (cond, cmask), _ = padded[tuple(batch)]
            forward(x[batch], float(sigmas[0]), cond, cmask)
    _sync(device)
    warmup = time.perf_counter() - tw
    step_seconds = []
    bar = tqdm(total=S * len(batches), desc="peer rollout [diffusers eager]", disable=not progress, leave=False)
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        for step in range(S):
            ts = time.perf_counter()
            x_next = torch.empty_like(x)
            sigma = float(sigmas[step])
            for batch in batches:
                (cond, cmask), (neg, nmask) = padded[tuple(batch)]
                xb = x[batch]
                v_cond = forward(xb, sigma, cond, cmask)
                v = cfg_combine(v_cond, forward(xb, sigma, neg, nmask), scale) if scale != 1.0 else v_cond
                x_next[batch], _ = step_latents(cfg.sampler, cfg.seed, v, xb, sigmas, step, batch)
                bar.update(1)
            x = x_next
            _sync(device)
            step_seconds.append(time.perf_counter() - ts)
    wall = time.perf_counter() - t0
    bar.close()
    return {"engine": "diffusers QwenImageTransformer2DModel, eager", "cfg": "two forwards per step (as QwenImagePipeline)",
            "batch_size": bs, "warmup_seconds": round(warmup, 3), "wall_seconds": round(wall, 3), "step_seconds": [round(s, 4) for s in step_seconds],
            "x_final": x.float().cpu()}

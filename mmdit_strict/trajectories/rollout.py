"""Rollout: batched CFG sampling with the Flow-GRPO SDE and keyed noise (the sampling engine side)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from ..kernels.runtime import runtime_mode
from ..kernels.trace import capture_trace
from ..sampling import euler_step, initial_latents, sde_step, step_noise
from . import artifact, partial
from .engine import velocity
from .record import StepRecorder, build_trajectory
from .setup import build_side_model, latent_grid, make_prompts, schedule, side_runtime

logger = logging.getLogger(__name__)


def step_latents(cfg: DictConfig, v: torch.Tensor, x: torch.Tensor, sigmas: torch.Tensor, step: int, ids: list[int],
                 prev_sample: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_{t+1}, logp_t) of one step; with ``prev_sample`` the logp is of that recorded sample."""
    sigma, sigma_prev = float(sigmas[step]), float(sigmas[step + 1])
    if not cfg.sampler.sde:
        x_next = euler_step(v, x, sigma, sigma_prev)
        return x_next, torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    noise = step_noise(int(cfg.seed), ids, step, tuple(x.shape[1:]), x.device)
    kw = dict(eta=float(cfg.sampler.eta), sigma_max=float(sigmas[1]))
    res = sde_step(v, x, sigma, sigma_prev, noise=noise, **kw)
    if prev_sample is None:
        return res.x_prev, res.logp
    return res.x_prev, sde_step(v, x, sigma, sigma_prev, prev_sample=prev_sample, **kw).logp


def run_rollout(cfg: DictConfig, out_dir: str | Path, progress: bool = True) -> artifact.Trajectory:
    """Sample every prompt for ``sampler.num_steps`` steps and write the artifact to ``out_dir``."""
    t0 = time.perf_counter()
    runtime = side_runtime(cfg, "rollout")
    model = build_side_model(cfg, runtime)
    arch = model.config
    device = cfg.model.device
    prompts = make_prompts(cfg, arch, device)
    grid = latent_grid(cfg, arch)
    sigmas = schedule(cfg, arch)
    S = sigmas.shape[0] - 1
    ids = list(range(len(prompts.embeds)))
    x = initial_latents(int(cfg.seed), ids, (grid[0] * grid[1], arch.in_channels), device)
    rec = StepRecorder(S, x)
    bs = int(cfg.rollout.batch_size)
    if bs < 1:
        raise ValueError(f"rollout.batch_size must be >= 1, got {bs}")
    batches = [ids[i:i + bs] for i in range(0, len(ids), bs)]
    key = partial.state_key("rollout", cfg, ignore=("recompute",))
    resumed = partial.load(out_dir, key, rec) if cfg.resume else None
    start = resumed.steps_done if resumed else 0
    wall_before = resumed.wall_s if resumed else 0.0
    if resumed:
        logger.info("rollout: resuming after step %d of %d", start, S)
        x = rec.x[start].to(device)
    bar = tqdm(total=S * len(batches), initial=start * len(batches), desc=f"rollout [{runtime.value}]",
               disable=not progress, leave=False)
    with capture_trace(resumed.trace if resumed else None) as trace, runtime_mode(runtime), torch.no_grad():
        for step in range(start, S):
            x_next = torch.empty_like(x)
            for batch in batches:
                xb = x[batch]
                blocks: list[list[str]] = []
                v = velocity(model, xb.to(model.dtype), [prompts.embeds[i] for i in batch], prompts.negative,
                             float(sigmas[step]), grid, float(cfg.sampler.cfg_scale), cfg.rollout.cfg_layout, cfg.rollout.pad_to,
                             block_hashes=blocks)
                xn, logp = step_latents(cfg, v, xb, sigmas, step, batch)
                rec.put(step, batch, v, xn, logp, blocks)
                x_next[batch] = xn
                bar.update(1)
            x = x_next
            partial.save_step(out_dir, key, rec, step, trace, wall_before + time.perf_counter() - t0)
    bar.close()
    side = {"batch_size": bs, "cfg_layout": cfg.rollout.cfg_layout, "pad_to": cfg.rollout.pad_to, "autograd": False,
            "resumed_after_step": start or None}
    traj = build_trajectory("rollout", cfg, model, runtime, prompts, sigmas, ids, grid, rec, trace,
                            wall_before + time.perf_counter() - t0, side, bool(cfg.rollout.save_tensors))
    artifact.write(traj, out_dir)
    partial.discard(out_dir)
    trace.dump(Path(out_dir) / "trace.json")
    return traj

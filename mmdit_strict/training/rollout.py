"""GRPO rollout of one epoch: groups of images per prompt, Flow-GRPO SDE on a window of steps, ODE elsewhere.

Everything random is keyed, never drawn from a shared stream (so a resumed run redraws the same):

* prompts of epoch ``e``: position ``q = e·P + j`` walks a permutation of the prompt set keyed by
  ``(seed, q // num_prompts)``;
* sample ids: ``e·P·G + g·G + k`` for image ``k`` of group ``g`` (unique over the whole run);
* initial latents: keyed by the sample id, or by the group's first sample id with ``same_latent``;
* SDE noise: ``step_noise(seed, sample_id, step)``;
* SDE window start of group ``g``: ``random.Random("window|seed|e|g")`` (logged per group).

The recorded ``logp[step, n]`` of every SDE step is the old policy's log-probability that training
reuses directly (no recompute pass).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from ..config.training import SampleConfig
from ..kernels.runtime import Runtime, runtime_mode
from ..model import MMDiT
from ..sampling import euler_step, initial_latents, sde_step, step_noise
from ..trajectories.engine import velocity
from ..trajectories.setup import Prompts


@contextlib.contextmanager
def side(model: MMDiT, runtime: Runtime) -> Iterator[None]:
    """Run ``model`` in ``runtime`` inside the block: the execution context's runtime, which its forward and
    the operator registry read (the model's default is left as it is)."""
    with runtime_mode(runtime):
        yield



@dataclass
class EpochSamples:
    """One epoch's rollout, on the model's device.

    Attributes:
        sample_ids: ``N`` global sample ids, group by group.
        prompt_ids: ``N`` prompt indices into the prompt set.
        x: ``(S + 1, N, T, 64)`` FP32 latents; ``x[0]`` initial noise, ``x[S]`` final.
        logp: ``(S, N)`` FP32 log-probabilities of the SDE transitions (0 on ODE steps).
        sde_steps: per sample, the steps taken with the SDE (the ones training may use).
        window_starts: per group, the SDE window's first step (0 when the window is every step).
    """

    sample_ids: list[int]
    prompt_ids: list[int]
    x: torch.Tensor
    logp: torch.Tensor
    sde_steps: list[list[int]]
    window_starts: list[int]

    @property
    def final(self) -> torch.Tensor:
        return self.x[-1]


def epoch_prompts(seed: int, epoch: int, num_prompts: int, per_epoch: int) -> list[int]:
    """Prompt indices of epoch ``epoch``: consecutive positions of keyed permutations of ``range(num_prompts)``."""
    if num_prompts < 1 or per_epoch < 1:
        raise ValueError(f"need at least one prompt and sample.prompts_per_epoch >= 1, got {num_prompts}, {per_epoch}")
    out = []
    for q in range(epoch * per_epoch, (epoch + 1) * per_epoch):
        order = list(range(num_prompts))
        random.Random(f"prompts|{seed}|{q // num_prompts}").shuffle(order)
        out.append(order[q % num_prompts])
    return out


def window_start(seed: int, epoch: int, group: int, num_steps: int, size: int, window_range: Sequence[int] | None) -> int:
    """First SDE step of group ``group``'s window (``size`` 0 or ≥ ``num_steps``: 0, every step is SDE)."""
    if size <= 0 or size >= num_steps:
        return 0
    lo, hi = (0, num_steps) if window_range is None else (int(window_range[0]), int(window_range[1]))
    if not (0 <= lo < hi <= num_steps) or hi - lo < size:
        raise ValueError(f"sample.sde_window_range must satisfy 0 <= lo < hi <= {num_steps} with hi - lo >= "
                         f"sde_window_size={size}, got {window_range}")
    return random.Random(f"window|{seed}|{epoch}|{group}").randrange(lo, hi - size + 1)


def plan_epoch(seed: int, epoch: int, num_prompts: int, scfg: SampleConfig, num_steps: int) -> tuple[list[int], list[int], list[int], list[int], list[list[int]]]:
    """(sample_ids, prompt_ids, init_ids, window_starts, sde_steps) of one epoch."""
    G = scfg.num_image_per_prompt
    prompts = epoch_prompts(seed, epoch, num_prompts, scfg.prompts_per_epoch)
    P = len(prompts)
    size = scfg.sde_window_size
    sids, pids, init_ids, starts, sde_steps = [], [], [], [], []
    for g, p in enumerate(prompts):
        start = window_start(seed, epoch, g, num_steps, size, scfg.sde_window_range)
        steps = list(range(num_steps)) if size <= 0 or size >= num_steps else list(range(start, start + size))
        starts.append(start)
        first = epoch * P * G + g * G
        for k in range(G):
            sids.append(first + k)
            pids.append(p)
            init_ids.append(first if scfg.same_latent else first + k)
            sde_steps.append(steps)
    return sids, pids, init_ids, starts, sde_steps


@torch.no_grad()
def rollout_epoch(
    model: MMDiT, runtime: Runtime, prompts: Prompts, sigmas: torch.Tensor, grid: tuple[int, int],
    scfg: SampleConfig, seed: int, epoch: int, positions: Sequence[int] | None = None,
) -> EpochSamples:
    """Sample one epoch's groups with batched forwards of ``scfg.batch_size`` samples (CFG per ``scfg.cfg_layout``).

    ``positions`` (default: all): the sample positions to roll out, batched in that order; the other
    samples keep their initial latents and zero logp (a rank's share; the caller gathers the rest).
    """
    S = sigmas.shape[0] - 1
    sids, pids, init_ids, starts, sde_steps = plan_epoch(seed, epoch, len(prompts.embeds), scfg, S)
    N = len(sids)
    todo = list(range(N)) if positions is None else list(positions)
    bs = scfg.batch_size
    device = model.device
    T, C = grid[0] * grid[1], model.config.in_channels
    xs = torch.empty(S + 1, N, T, C, dtype=torch.float32, device=device)
    xs[0] = initial_latents(seed, init_ids, (T, C), device)
    logp = torch.zeros(S, N, dtype=torch.float32, device=device)
    sigma_max = float(sigmas[1])
    with side(model, runtime):
        for step in range(S):
            s, sp = float(sigmas[step]), float(sigmas[step + 1])
            for b0 in range(0, len(todo), bs):
                rows = todo[b0:b0 + bs]
                x = xs[step, rows]
                v = velocity(model, x.to(model.dtype), [prompts.embeds[pids[n]] for n in rows],
                             prompts.negatives_of([pids[n] for n in rows]),
                             s, grid, scfg.guidance_scale, scfg.cfg_layout, images=prompts.images_of([pids[n] for n in rows]))
                sde = [j for j, n in enumerate(rows) if step in sde_steps[n]]
                ode = [j for j, n in enumerate(rows) if step not in sde_steps[n]]
                if sde:
                    ids = [sids[rows[j]] for j in sde]
                    noise = step_noise(seed, ids, step, (T, C), device)
                    res = sde_step(v[sde], x[sde], s, sp, noise=noise, eta=scfg.noise_level, sigma_max=sigma_max)
                    idx = [rows[j] for j in sde]
                    xs[step + 1, idx] = res.x_prev
                    logp[step, idx] = res.logp
                if ode:
                    xs[step + 1, [rows[j] for j in ode]] = euler_step(v[ode], x[ode], s, sp)
    return EpochSamples(sids, pids, xs, logp, sde_steps, starts)


@torch.no_grad()
def ode_sample(model: MMDiT, runtime: Runtime, prompts: Prompts, prompt_ids: Sequence[int], sigmas: torch.Tensor,
               grid: tuple[int, int], scfg: SampleConfig, seed: int, id_base: int) -> torch.Tensor:
    """Deterministic Euler sampling (eval): final latents ``(len(prompt_ids), T, 64)`` FP32.

    Initial latents are keyed by ``id_base + i`` so every evaluation starts from the same noise.
    """
    S = sigmas.shape[0] - 1
    T, C = grid[0] * grid[1], model.config.in_channels
    x = initial_latents(seed, [id_base + i for i in range(len(prompt_ids))], (T, C), model.device)
    bs = scfg.batch_size
    with side(model, runtime):
        for step in range(S):
            s, sp = float(sigmas[step]), float(sigmas[step + 1])
            nxt = torch.empty_like(x)
            for b0 in range(0, x.shape[0], bs):
                rows = list(range(b0, min(x.shape[0], b0 + bs)))
                v = velocity(model, x[rows].to(model.dtype), [prompts.embeds[prompt_ids[n]] for n in rows],
                             prompts.negatives_of([prompt_ids[n] for n in rows]),
                             s, grid, scfg.guidance_scale, scfg.cfg_layout,
                             images=prompts.images_of([prompt_ids[n] for n in rows]))
                nxt[rows] = euler_step(v, x[rows], s, sp)
            x = nxt
    return x

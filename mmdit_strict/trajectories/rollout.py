"""Rollout: batched CFG sampling with the Flow-GRPO SDE and keyed noise (the sampling engine side)."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from .. import distributed
from ..kernels.runtime import runtime_mode
from ..kernels.trace import capture_trace
from ..model import MMDiT
from ..model.graphs import graph_stats
from ..sampling import euler_step, initial_latents, sde_step, step_noise
from . import artifact, partial
from ..overlay import perturb_fields, perturbing
from ..parallel import ModelLayout, model_parallel
from .engine import sampling_op, timed, time_split, velocity
from .record import StepRecorder, build_trajectory, model_hashes
from ..config.schema import SamplerConfig
from .setup import Prompts, build_side_model, check_pad_to, latent_grid, make_prompts, schedule, side_runtime
from .stagekey import rollout_key

logger = logging.getLogger(__name__)


def step_latents(sampler: SamplerConfig, seed: int, v: torch.Tensor, x: torch.Tensor, sigmas: torch.Tensor, step: int,
                 ids: list[int], prev_sample: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_{t+1}, logp_t) of one step (``sampler.sde``, ``sampler.eta``; noise keyed by ``seed`` and the sample ids);
    with ``prev_sample`` the logp is of that recorded sample. ``sigmas`` is the table as the side uses it
    (:func:`used_sigmas`). Each sampling operator passes :func:`~.engine.sampling_op` (overlay, trace, capture)."""
    sigma, sigma_prev = float(sigmas[step]), float(sigmas[step + 1])
    with timed("scheduler", x.device):
        if not sampler.sde:
            x_next = sampling_op("flow_euler_step", euler_step, v, x, sigma, sigma_prev)
            return x_next, torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        noise = sampling_op("step_noise", step_noise, seed, list(ids), step, tuple(x.shape[1:]), x.device)
        kw = dict(eta=float(sampler.eta), sigma_max=float(sigmas[1]))
        res = sampling_op("flow_sde_step_logp", sde_step, v, x, sigma, sigma_prev, noise=noise, **kw)
        if prev_sample is None:
            return res.x_prev, res.logp
        return res.x_prev, sampling_op("flow_sde_step_logp", sde_step, v, x, sigma, sigma_prev, prev_sample=prev_sample, **kw).logp


def used_sigmas(table: torch.Tensor) -> torch.Tensor:
    """The sigma table as this side uses it: the recorded / scheduled ``table`` through the sampling operator
    ``flow_sigma_table`` (a perturbation of the schedule acts here; the artifact records ``table`` itself)."""
    return sampling_op("flow_sigma_table", lambda t: t, table)


def rollout_batches(batch_size: int, n: int) -> list[list[int]]:
    """The rollout's batches of sample ids (``rollout.batch_size`` at a time, in order)."""
    if batch_size < 1:
        raise ValueError(f"rollout.batch_size must be >= 1, got {batch_size}")
    return [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]


def warm_up(cfg: DictConfig, model: MMDiT, prompts: Prompts) -> float:
    """One forward per batch layout of the rollout, untimed by it: JIT compiles and CUDA-graph capture.

    Returns the seconds it took (the run reports it as its own phase). The rollout that follows replays
    the graphs captured here; its bytes are those of an uncaptured forward (``model/graphs.py``).
    """
    t0 = time.perf_counter()
    arch = model.config
    grid = latent_grid(cfg.sampler, arch)
    sigmas = schedule(cfg.sampler, arch)
    ids = list(range(len(prompts.embeds)))
    x = initial_latents(cfg.seed, ids, (grid[0] * grid[1], arch.in_channels), cfg.model.device)
    layout = ModelLayout.from_config(cfg.rollout.get("parallel"))
    with runtime_mode(model.runtime), torch.no_grad(), model_parallel(layout):
        for batch in {tuple(b) for b in distributed.SidePlan(ids, cfg.rollout.batch_size, layout.size).batches}:
            velocity(model, x[list(batch)].to(model.dtype), [prompts.embeds[i] for i in batch], prompts.negatives_of(list(batch)),
                     float(sigmas[0]), grid, cfg.sampler.cfg_scale, cfg.rollout.cfg_layout, cfg.rollout.pad_to,
                     images=prompts.images_of(list(batch)))
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - t0


def run_rollout(cfg: DictConfig, out_dir: str | Path, progress: bool = True, model: MMDiT | None = None,
                hashes: dict[str, str | None] | None = None) -> artifact.Trajectory:
    """Sample every prompt for ``sampler.num_steps`` steps and write the artifact to ``out_dir``.

    ``model`` is the rollout side's model when the caller already built it (``build_side_model``
    with the rollout runtime), and ``hashes`` its :func:`model_hashes` when already computed. A step checkpoint in ``<out_dir>.partial`` is resumed only under the
    same stage key (settings, weights, LoRA, prompts, version) and only as far as its step files verify.
    """
    t0 = time.perf_counter()
    runtime = side_runtime(cfg, "rollout")
    if model is None:
        model = build_side_model(cfg.model, cfg.lora, runtime)
    elif model.runtime is not runtime:
        raise ValueError(f"run_rollout got a model in runtime {model.runtime.value}, the rollout side runs {runtime.value}")
    hashes = hashes if hashes is not None else model_hashes(model)
    distributed.agree("rollout model", hashes)  # torchrun: every rank built the same model
    arch = model.config
    device = cfg.model.device
    prompts = make_prompts(cfg.prompts, arch, device, cfg.model.dtype)
    check_pad_to("rollout", cfg.rollout.pad_to, prompts, cfg.sampler.cfg_scale)
    grid = latent_grid(cfg.sampler, arch)
    sigmas = schedule(cfg.sampler, arch)
    S = sigmas.shape[0] - 1
    ids = list(range(len(prompts.embeds)))
    x = initial_latents(int(cfg.seed), ids, (grid[0] * grid[1], arch.in_channels), device)
    rec = StepRecorder(S, x)
    bs = cfg.rollout.batch_size
    rollout_batches(bs, len(ids))  # checks rollout.batch_size
    layout = ModelLayout.from_config(cfg.rollout.get("parallel"))
    plan = distributed.SidePlan(list(range(len(ids))), bs, layout.size)  # torchrun: this rank's share of the samples
    batches = plan.batches
    key = rollout_key(cfg, hashes, prompts.hashes())
    resumed = plan.resume(rec, lambda: partial.load(out_dir, key, rec, "rollout") if cfg.resume else None,
                          lambda: partial.start(out_dir, key))
    start = resumed.steps_done if resumed else 0
    wall_before = resumed.wall_s if resumed else 0.0
    if resumed:
        logger.info("rollout: resuming after step %d of %d", start, S)
        x = rec.x[start].to(device)
    step_seconds: list[float] = []
    bar = tqdm(total=S * len(batches), initial=start * len(batches), desc=f"rollout [{runtime.value}]",
               disable=not progress, leave=False)
    with capture_trace(resumed.trace if resumed else None) as trace, runtime_mode(runtime), torch.no_grad(), \
            perturbing(cfg.rollout.perturb, model, runtime.value) as overlay, time_split() as split, \
            model_parallel(layout):
        with capture_trace() if resumed else contextlib.nullcontext():  # a resumed trace already counts its read
            used = used_sigmas(sigmas)
        for step in range(start, S):
            t_step = time.perf_counter()
            x_next = torch.empty_like(x)
            for batch in batches:
                xb = x[batch]
                blocks: list[list[str]] = []
                v = velocity(model, xb.to(model.dtype), [prompts.embeds[i] for i in batch], prompts.negatives_of(batch),
                             float(used[step]), grid, cfg.sampler.cfg_scale, cfg.rollout.cfg_layout, cfg.rollout.pad_to,
                             block_hashes=blocks, images=prompts.images_of(batch))
                xn, logp = step_latents(cfg.sampler, cfg.seed, v, xb, used, step, batch)
                rec.put(step, batch, v, xn, logp, blocks)
                x_next[batch] = xn
                bar.update(1)
            x = x_next
            plan.end_step(rec, step)  # torchrun: every rank's rows of this step move to rank 0
            if plan.root:
                partial.save_step(out_dir, rec, step, trace, wall_before + time.perf_counter() - t0)
            step_seconds.append(round(time.perf_counter() - t_step, 4))  # save_step read the step back: synced
    bar.close()
    side = {"batch_size": bs, "cfg_layout": cfg.rollout.cfg_layout, "pad_to": cfg.rollout.pad_to, "autograd": False,
            "resumed_after_step": start or None, "step_seconds": step_seconds, **perturb_fields(cfg.rollout.perturb, overlay),
            **({"parallel": layout.describe()} if not layout.trivial else {}),
            "time_split": {k: round(v, 4) for k, v in split.items()}, "cuda_graphs": graph_stats(model),
            **plan.side_fields(ids)}
    trace = plan.merge_trace(trace)

    def write() -> artifact.Trajectory:
        traj = build_trajectory("rollout", cfg, model, runtime, prompts, sigmas, ids, grid, rec, trace,
                                wall_before + time.perf_counter() - t0, side, bool(cfg.rollout.save_tensors),
                                hashes=hashes, stage_key=key)
        artifact.write(traj, out_dir)
        partial.discard(out_dir)
        trace.dump(Path(out_dir) / "trace.json")
        return traj

    return plan.write("rollout: write the artifact", write)  # rank 0 writes; every rank gets the artifact

"""Recompute: the training side re-evaluates every step from the recorded x_t with autograd on.

It replays the rollout artifact's inputs (prompt embeddings, initial latents, sigma table, keyed
noise), in its own batch composition: shuffled sample order, micro-batches, its own CFG layout
and padding, LoRA attached, gradient checkpointing, and a backward of ``-sum(logp)`` per micro-batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
import re
import time
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from .. import distributed
from ..config.arch import preset
from ..kernels.grad_sink import SampleGradSink, collect_sample_grads
from ..kernels.runtime import Runtime, runtime_mode
from ..kernels.trace import capture_trace
from ..model import build_model
from ..model.edit import split_conditioning
from ..model.graphs import graph_stats
from .conditioning import recorded_grids
from ..model.strict import capture_operators, inject_fault, strict_forward
from . import artifact, partial
from ..overlay import perturb_fields, perturbing
from ..parallel import ModelLayout, model_parallel
from .engine import timed, time_split, velocity
from .hashing import tensor_sha256
from .record import StepRecorder, build_trajectory, model_hashes
from .rollout import step_latents, used_sigmas
from .setup import Prompts, build_side_model, check_pad_to, side_runtime
from .stagekey import recompute_key


def recorded_prompts(traj: artifact.Trajectory, dtype: torch.dtype, device: str) -> Prompts:
    """The prompts (and edit conditioning) a rollout artifact recorded, as the recompute replays them."""
    n = len(traj.manifest["prompt_hashes"]["prompts"])
    embeds = [traj.tensors[f"prompt.{i}"].to(device=device, dtype=dtype) for i in range(n)]
    cond = traj.manifest.get("conditioning")
    images = None if not cond else [split_conditioning(traj.tensors[f"condition.{i}"], recorded_grids(g))
                                    for i, g in enumerate(cond["grids"])]
    negatives = None
    if "negatives" in traj.manifest["prompt_hashes"]:  # per-prompt negatives (edit prompts encoded with their images)
        negatives = [traj.tensors[f"negative.{i}"].to(device=device, dtype=dtype) for i in range(n)]
    return Prompts(embeds, traj.tensors["negative"].to(device=device, dtype=dtype), images, negatives)


def micro_batches(ids: list[int], size: int, shuffle: bool, seed: int) -> list[list[int]]:
    if size < 1:
        raise ValueError(f"recompute.micro_batch must be >= 1, got {size}")
    order = list(ids)
    if shuffle:
        random.Random(seed).shuffle(order)
    return [order[i:i + size] for i in range(0, len(order), size)]


def parse_fault(spec: str | None) -> tuple[str | None, int | None]:
    """``"block1.img.mlp_down_gemm@2"`` → (key, step); ``None`` → (None, None). A key may name a row of the
    output, ``block0.img.mlp_down_gemm#70@1`` (packed row 70 of that forward: with edit conditioning the
    first sample's conditioning image starts at row ``h·w``); the key keeps it for ``inject_fault``."""
    if not spec:
        return None, None
    key, _, step = spec.partition("@")
    op, _, row = key.partition("#")
    if not op or (step and not step.isdigit()) or ("#" in key and not row.isdigit()):
        raise ValueError(f"recompute.inject_fault must look like 'block1.img.mlp_down_gemm@2' (or with a row, "
                         f"'block1.img.mlp_down_gemm#70@2'), got {spec!r}")
    return key, int(step) if step else 0


_BLOCK = re.compile(r"^block(\d+)\.")


@functools.lru_cache(maxsize=1)
def operator_keys() -> frozenset[str]:
    """Every operator key the strict forward emits, with block indices written as ``block{}``.

    Read off one captured forward of a one-block tiny model: the graph (and so the set of keys) is
    the same for every size; only the number of blocks differs.
    """
    arch = dataclasses.replace(preset("tiny"), num_layers=1)
    model = build_model(arch, seed=0, runtime="strict")
    x = torch.zeros(1, 4, arch.in_channels)
    text = torch.zeros(1, 2, arch.joint_attention_dim)
    inputs = model.validate_inputs(x, text, None, torch.tensor([0.5]), [[(1, 2, 2)]])
    with runtime_mode(Runtime.STRICT), capture_operators() as cap, torch.no_grad():
        strict_forward(model, inputs)
    # tuple outputs are captured as key.0, key.1; a fault names the operator call itself
    return frozenset(_BLOCK.sub("block{}.", re.sub(r"\.\d+$", "", k)) for k in cap) | SAMPLING_FAULT_KEYS


#: Sampling operators a fault can name (they run inside each step; the sigma table is read once per side).
SAMPLING_FAULT_KEYS = frozenset({"sampling.cfg_combine_renorm", "sampling.step_noise", "sampling.flow_sde_step_logp"})


def check_fault(spec: str | None, num_layers: int, num_steps: int) -> None:
    """A clear error unless ``recompute.inject_fault`` names an operator call the strict graph makes."""
    key, step = parse_fault(spec)
    if key is None or step is None:
        return
    key = key.partition("#")[0]
    if step >= num_steps:
        raise ValueError(f"recompute.inject_fault={spec!r} names step {step} but the run has {num_steps} steps")
    m = _BLOCK.match(key)
    if m and int(m.group(1)) >= num_layers:
        raise ValueError(f"recompute.inject_fault={spec!r} names block {m.group(1)} but the model has {num_layers} blocks")
    known = operator_keys()
    if _BLOCK.sub("block{}.", key) not in known:
        examples = ", ".join(sorted(k.format(0) for k in known if k.startswith("block{}.img"))[:4])
        raise ValueError(f"recompute.inject_fault={spec!r}: {key!r} is no operator call of the strict graph "
                         f"(keys look like {examples}, embed.timestep_embed_mlp)")


#: Settings a recompute replays from its rollout: they must be the rollout's own (the rest is the training side's choice).
REPLAYED = ("seed", "sampler")


def check_replay_settings(cfg: DictConfig, rollout: artifact.Trajectory) -> None:
    """A clear error, naming every key, when ``cfg`` sets a replayed setting otherwise than the rollout recorded it."""
    from omegaconf import OmegaConf

    recorded = rollout.manifest["config"]
    diffs = []
    for section in REPLAYED:
        now, then = OmegaConf.to_container(cfg, resolve=True).get(section), recorded.get(section)
        pairs = {k: (now.get(k), then.get(k)) for k in sorted(set(now) | set(then))} if isinstance(now, dict) and isinstance(then, dict) \
            else {"": (now, then)}
        diffs += [f"{section}{'.' + k if k else ''}={a!r} (rollout: {b!r})" for k, (a, b) in pairs.items() if a != b]
    if diffs:
        raise ValueError(f"recompute settings differ from the rollout it replays ({rollout.path}): {', '.join(diffs)}; "
                         "drop these overrides or sample a new rollout with them")


def step_sink(distributed_plan: bool, sample_ids: list, cfg_scale: float) -> SampleGradSink:
    """The grad sink of one recompute step. One process: the streamed fold over every key the step deposits,
    ``(sample_id, branch)`` with branch 0 (conditional) and, under CFG, 1 (negative), which holds a few tree nodes
    per parameter instead of every key's partial, and takes the captured steps' flat partials as one group.
    torchrun: the stored fold, whose per-key partials move to rank 0 (:func:`distributed.fold.rank_partials`).
    Both give the same bytes; autograd's sums stay on (their hash is recorded too)."""
    return SampleGradSink() if distributed_plan else SampleGradSink(sink_keys(sample_ids, cfg_scale))


def sink_keys(sample_ids: list, cfg_scale: float) -> list[tuple]:
    """The grad-sink keys the velocity's forwards give these samples: ``(sample_id, branch)``, branch 1 only with CFG."""
    branches = (0,) if cfg_scale == 1.0 else (0, 1)
    return [(i, br) for i in sample_ids for br in branches]


def _grad_record(trainable: list, sink) -> dict | None:
    """Hashes of one step's LoRA gradients: folded in global sample order (split-invariant) and as autograd summed them.

    Parameters that received no gradient this step (e.g. the text-stream output projection of the
    last block, whose output is discarded) are left out of both.
    """
    with_grad = [(n, p) for n, p in trainable if p.grad is not None]
    if not with_grad:
        return None
    folded = [sink.fold(p) for _, p in with_grad]
    rec: dict = {"params": len(with_grad),
                 "autograd_sha256": tensor_sha256(torch.cat([p.grad.reshape(-1) for _, p in with_grad]))}
    missing = [n for (n, _), f in zip(with_grad, folded) if f is None]
    if missing:
        rec["unfolded"] = missing  # a backend without per-sample partials (not strict) ran these
    else:
        flat = torch.cat([f.reshape(-1) for f in folded])
        rec["sample_order_sha256"] = tensor_sha256(flat)
        rec["norm"] = float(flat.double().norm())
    return rec


def _merged_grad_record(trainable: list, shares: list[dict]) -> dict | None:
    """torchrun: :func:`_grad_record`'s sample-order fold over every rank's partials, moved to rank 0
    (``distributed.fold``: the single-process fold's bytes); autograd's sums are per rank (layout records)."""
    names = [n for n, _ in trainable if any(n in s["with_grad"] for s in shares)]
    if not names:
        return None
    folded = [distributed.fold.fold_ranks(n, shares) for n in names]
    rec: dict = {"params": len(names), "autograd_sha256_per_rank": [s["autograd_sha256"] for s in shares]}
    missing = [n for n, f in zip(names, folded) if f is None]
    if missing:
        rec["unfolded"] = missing
    else:
        flat = torch.cat([f.reshape(-1) for f in folded])
        rec["sample_order_sha256"] = tensor_sha256(flat)
        rec["norm"] = float(flat.double().norm())
    return rec


def run_recompute(cfg: DictConfig, rollout: artifact.Trajectory, out_dir: str | Path, progress: bool = True) -> artifact.Trajectory:
    """Recompute v_t, x_{t+1}, logp_t for every recorded step and write the artifact to ``out_dir``."""
    artifact.require_kind(rollout, "rollout")
    check_replay_settings(cfg, rollout)
    if not rollout.has_tensors():
        raise artifact.TrajectoryError("the rollout artifact holds no tensors; rerun rollout with rollout.save_tensors=true")
    t0 = time.perf_counter()
    runtime = side_runtime(cfg, "recompute")
    model = build_side_model(cfg.model, cfg.lora, runtime)
    model.enable_gradient_checkpointing(bool(cfg.recompute.grad_checkpointing),
                                        keep_attention_outputs=bool(cfg.recompute.keep_attention_outputs))
    hashes = model_hashes(model)
    distributed.agree("recompute model", hashes)  # torchrun: every rank built the same model
    for key, val in hashes.items():
        if val != rollout.manifest[key]:
            raise artifact.TrajectoryError(
                f"recompute model {key} {str(val)[:12]}… differs from the rollout's {str(rollout.manifest[key])[:12]}…: "
                "not the same policy (check model.* and lora.* overrides)"
            )
    device = cfg.model.device
    prompts = recorded_prompts(rollout, model.dtype, device)
    check_pad_to("recompute", cfg.recompute.pad_to, prompts, float(cfg.sampler.cfg_scale))
    grid = tuple(rollout.manifest["grid"])
    sigmas = rollout.tensors["sigmas"]
    S = sigmas.shape[0] - 1
    check_fault(cfg.recompute.inject_fault, model.config.num_layers, S)
    ids = rollout.sample_ids
    xs = rollout.tensors["x"].to(device)
    rec = StepRecorder(S, xs[0])
    mbs = micro_batches(list(range(len(ids))), int(cfg.recompute.micro_batch), bool(cfg.recompute.shuffle), int(cfg.recompute.shuffle_seed))
    # torchrun: this rank's block of the shuffled order, cut into micro-batches (docs/distributed.md)
    layout = ModelLayout.from_config(cfg.recompute.get("parallel"))
    plan = distributed.SidePlan([i for mb in mbs for i in mb], int(cfg.recompute.micro_batch), layout.size)
    trainable = sorted(((n, p) for n, p in model.named_parameters() if p.requires_grad), key=lambda t: t[0])
    bar = tqdm(total=S * len(plan.batches), desc=f"recompute [{runtime.value}]", disable=not progress, leave=False)
    key = recompute_key(cfg, hashes, rollout)
    resumed = plan.resume(rec, lambda: partial.load(out_dir, key, rec, "recompute") if cfg.resume else None,
                          lambda: partial.start(out_dir, key))
    start = resumed.steps_done if resumed else 0
    wall_before = resumed.wall_s if resumed else 0.0
    grad_records = list(resumed.step_extras) if resumed else []
    bar.update(start * len(plan.batches))
    fault_key, fault_step = parse_fault(cfg.recompute.inject_fault)
    plan_ids = [ids[i] for mb in plan.batches for i in mb]  # this rank's samples, whose keys each step's sink declares
    cfg_scale = float(cfg.sampler.cfg_scale)
    with capture_trace(resumed.trace if resumed else None) as trace, runtime_mode(runtime), \
            perturbing(cfg.recompute.perturb, model, runtime.value) as overlay, time_split() as split, \
            model_parallel(layout) as mpar:
        with capture_trace() if resumed else contextlib.nullcontext():  # a resumed trace already counts its read
            used = used_sigmas(sigmas)
        for step in range(start, S):
            fault_here = fault_key if step == fault_step else None
            with collect_sample_grads(step_sink(plan.distributed, plan_ids, cfg_scale)) as sink:
                for mb in plan.batches:
                    x_t, x_rec = xs[step][mb], xs[step + 1][mb]
                    mb_ids = [ids[i] for i in mb]
                    with inject_fault(fault_here), torch.set_grad_enabled(bool(cfg.recompute.autograd)):
                        blocks: list[list[str]] = []
                        v = velocity(model, x_t.to(model.dtype), [prompts.embeds[i] for i in mb], prompts.negatives_of(mb),
                                     float(used[step]), grid, cfg_scale, cfg.recompute.cfg_layout,
                                     cfg.recompute.pad_to, block_hashes=blocks, sample_ids=mb_ids,
                                     images=prompts.images_of(mb))
                        x_next, logp = step_latents(cfg.sampler, cfg.seed, v, x_t, used, step, mb_ids, prev_sample=x_rec)
                        if logp.requires_grad:
                            with timed("model", x_t.device):  # the backward runs through the transformer
                                (-logp.sum()).backward()
                    if sink.streamed:  # a parameter these keys did not reach waits for them no longer
                        sink.done(sink_keys(mb_ids, cfg_scale))
                    rec.put(step, mb, v, x_next, logp, blocks)
                    bar.update(1)
            if plan.distributed:  # torchrun: rows and gradient partials of every rank move to rank 0
                share = distributed.fold.rank_partials(trainable, sink)
                with_grad = [p.grad.reshape(-1) for _, p in trainable if p.grad is not None]
                share["autograd_sha256"] = tensor_sha256(torch.cat(with_grad)) if with_grad else None
                if mpar is not None and not mpar.sends_partials:
                    share = None  # the sequence and tensor ranks of a branch hold the same partials: one sends them
                shares = plan.end_step(rec, step, extra=share)
                shares = None if shares is None else [sh for sh in shares if sh is not None]
                grad_records.append(_merged_grad_record(trainable, shares) if shares is not None else None)
            else:
                grad_records.append(_grad_record(trainable, sink))
            for _, p in trainable:
                p.grad = None
            if plan.root:
                partial.save_step(out_dir, rec, step, trace, wall_before + time.perf_counter() - t0, extra=grad_records[-1])
    bar.close()
    side = {"micro_batch": int(cfg.recompute.micro_batch), "shuffle": bool(cfg.recompute.shuffle),
            "order": [ids[i] for mb in mbs for i in mb], "cfg_layout": cfg.recompute.cfg_layout, "pad_to": cfg.recompute.pad_to,
            "autograd": bool(cfg.recompute.autograd), "grad_checkpointing": bool(cfg.recompute.grad_checkpointing),
            "keep_attention_outputs": bool(cfg.recompute.keep_attention_outputs),
            "inject_fault": cfg.recompute.inject_fault, **perturb_fields(cfg.recompute.perturb, overlay),
            **({"parallel": layout.describe()} if not layout.trivial else {}),
            "time_split": {k: round(v, 4) for k, v in split.items()}, "resumed_after_step": start or None,
            "lora_grads_per_step": grad_records, "cuda_graphs": graph_stats(model), **plan.side_fields(ids)}
    trace = plan.merge_trace(trace)

    def write() -> artifact.Trajectory:
        traj = build_trajectory("recompute", cfg, model, runtime, prompts, sigmas, ids, grid, rec, trace,
                                wall_before + time.perf_counter() - t0, side, True, hashes=hashes, stage_key=key)
        artifact.write(traj, out_dir)
        partial.discard(out_dir)
        trace.dump(Path(out_dir) / "trace.json")
        return traj

    return plan.write("recompute: write the artifact", write)  # rank 0 writes; every rank gets the artifact

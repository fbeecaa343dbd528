"""One Flow-GRPO update timed phase by phase: our strict engine vs diffusers + PEFT, same weights, same run.

    python -m mmdit_strict.bench.train --out DIR [--layers N] [--grid H W] [--txt L] [--prompts P] [--fresh-prompts]
        [--group G] [--steps S] [--window W] [--micro-batch B] [--lora-rank R] [--device cuda|cpu] [--arch qwen-image|tiny]

Both engines start from one set of base weights: ours built by ``build_model``, theirs diffusers'
``QwenImageTransformer2DModel`` holding the same parameter storage (``diffusers_twin``). Each gets a PEFT
LoRA on :data:`~mmdit_strict.bench.model.LORA_TARGETS` with the same initial values (``attach_lora``, B
non-zero), gradient checkpointing, and its own AdamW (``build_optimizer``, the trainer's defaults). One
update, for each engine through the same training functions, is three phases:

* ``rollout``: a group of ``G`` samples of each of ``P`` prompts (default 1; several prompts get lengths drawn in
  ``[L/2, L]``, so the training forwards meet several batch layouts, as an epoch of ``train`` does), ``S`` steps with
  true CFG (conditional and negative
  prompt), the Flow-GRPO SDE on a keyed window of ``W`` steps and Euler elsewhere, no autograd
  (``training.rollout.rollout_epoch``: keyed latents and noise, ``sde_step`` and its logp, ``cfg_combine``);
* ``train``: the ``W × P × G`` (sample, step) pairs in gradient-key order, ``B`` pairs per micro-batch: forward
  with autograd and CFG (``evaluate_pairs``), ``grpo_loss`` against the rollout's logp with advantages
  standardised from the fixed rewards ``0, 1, …, G-1``, backward. Ours runs in the strict runtime with its
  gradient sink collecting per-(pair, branch) partials; theirs runs plain autograd;
* ``optimizer``: (ours: fold the sink's partials into the gradients) clip the norm, AdamW step, zero grads.

Ours runs in ``strict`` with CUDA graphs for the rollout's no-grad forwards (on CUDA), theirs eager in the
``off`` runtime (PyTorch's default math, as diffusers users run it). Both use one CFG layout (``--cfg-layout``,
default sequential: two forwards per step, as ``QwenImagePipeline``). On the CPU the model is FP32 (the CPU
strict backend's dtype), on CUDA BF16.

Per engine: ``--warmup`` untimed updates (compiles, graph captures, allocator; with ``--fresh-prompts`` each update
draws its own prompt lengths, so the timed update captures its layouts as an epoch of ``train`` does), one timed update (wall seconds
of each phase with the GPU synchronised, peak and starting memory), then on CUDA one more update under the
profiler (GPU activities and host launches per phase; ``gpu_busy`` is that update's GPU time over the timed
update's wall). ``first_update_ratio_exact_one`` checks the first update's recomputed logp against its
rollout's, byte for byte, and every importance ratio is exactly 1. Writes ``DIR/train_bench.json``,
``DIR/train_bench.md`` and ``DIR/train_bench.png`` (wall per phase and peak memory per engine; ``--replot
REPORT.json`` redraws it). A benchmark: an engine that fails has its error recorded instead of figures.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from ..config.arch import ArchConfig, preset
from ..config.schema import LoraConfig, PromptsConfig
from ..config.training import SampleConfig, TrainConfig
from ..dtypes import BY_CONFIG_NAME as DTYPES
from ..environment import environment_line, run_environment
from ..kernels.fold_park import HostBuffers, HostPark
from ..kernels.grad_sink import SampleGradSink, collect_sample_grads
from ..kernels.runtime import Runtime
from ..model.graphs import graph_stats, release_forward_graphs, release_training_graphs
from ..sampling import sigma_table
from ..training.advantages import StatTracker
from ..training.loss import grpo_loss, logp_bytes_differ
from ..training.optim import build_optimizer
from ..training.policy import evaluate_pairs, grad_keys, pair_key
from ..training.rollout import EpochSamples, rollout_epoch, side
from ..trajectories.setup import Prompts, attach_lora, make_prompts
from . import markdown as md
from .model import LORA_TARGETS
from .output import replot, write_report
from .train_plot import plot
from .timing import gpu_profile

PHASES = ("rollout", "train", "optimizer")
#: Per architecture: latent grid, prompt tokens and LoRA rank when the flags leave them out.
SIZES = {"qwen-image": {"grid": (64, 64), "txt": 128, "lora_rank": 64}, "tiny": {"grid": (4, 4), "txt": 8, "lora_rank": 4}}
CFG_SCALE, ETA, SEED = 4.0, 0.7, 0  # configs/sampler/flow_grpo.yaml's cfg_scale and eta; the noise seed


@dataclass
class Engine:
    """One side of the comparison: a transformer with its LoRA, the runtime it runs in, how it folds gradients."""

    name: str
    model: torch.nn.Module
    runtime: Runtime
    grad_sink: bool  # fold per-(pair, branch) partials through the strict gradient sink
    what: str
    park_fold_nodes: bool = False  # the sink's waiting fold nodes in host memory (train.park_fold_nodes)
    park_lookahead: int | None = None  # keys before a parked node's join at which it comes back (train.park_lookahead)
    park_buffers: HostBuffers = field(default_factory=HostBuffers)  # kept across updates, as train keeps them
    micro_batch: int | None = None  # pairs per training forward, where it is not the update's (ours: same bytes any way)
    cfg_layout: str | None = None  # the training forwards' CFG layout, where it is not the update's
    release_training_graphs: bool = False  # drop the captured training steps before each rollout (train.release_training_graphs)


@dataclass
class Update:
    """What every update of both engines shares: the prompt, schedule, rollout and training settings."""

    prompts: Prompts
    sigmas: torch.Tensor
    grid: tuple[int, int]
    scfg: SampleConfig
    tcfg: TrainConfig
    advantages: torch.Tensor  # (G,) FP32 on the device


def check_args(args: argparse.Namespace) -> None:
    """Refuse sizes that make no update, with the flag's name."""
    if args.micro_batch < 1:
        raise ValueError(f"--micro-batch must be >= 1 pair, got {args.micro_batch}")
    if args.ours_micro_batch is not None and args.ours_micro_batch < 1:
        raise ValueError(f"--ours-micro-batch must be >= 1 pair, got {args.ours_micro_batch}")
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if not 1 <= args.window <= args.steps:
        raise ValueError(f"--window must be between 1 and --steps ({args.steps}): the SDE window is a run of the "
                         f"sampling steps, got {args.window}")
    if args.group < 2:
        raise ValueError(f"--group must be >= 2: GRPO advantages compare the samples of a group, got {args.group}")
    if args.prompts < 1:
        raise ValueError(f"--prompts must be >= 1, got {args.prompts}")
    if (args.layers is not None and args.layers < 1) or args.txt < 1 or args.lora_rank < 1 or min(args.grid) < 1:
        raise ValueError("--layers, --txt, --lora-rank and --grid must be positive")
    if args.park_lookahead is not None and args.park_lookahead < 0:
        raise ValueError(f"--park-lookahead must be >= 0 keys, got {args.park_lookahead}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but this machine has no CUDA GPU (use --device cpu --arch tiny)")
    if args.device == "cpu" and args.arch == "qwen-image" and args.layers is None:
        raise ValueError("--arch qwen-image on the CPU builds the 20B model: pass --arch tiny, or --layers N for a slice")


def build_engines(arch: ArchConfig, device: str, dtype: torch.dtype, rank: int, shared_pools: bool = True,
                  fold_batches: bool = False, keep_attention_outputs: bool = True,
                  names: Sequence[str] = ("diffusers_peft", "ours", "ours_parked"), carry: bool = False) -> list[Engine]:
    """Theirs (diffusers + PEFT, first: it runs before ours holds CUDA-graph memory) and ours, on one weight storage,
    those of ``names`` (only their models get a LoRA, so a process that runs one side holds one adapter, as a user's
    does; ``shared_pools`` False: ours gives each captured graph its own memory pool, to measure what sharing saves;
    ``fold_batches``: ours folds a batch that is one node of the sink's tree inside its captured backward, and with
    ``carry`` adds a right child's node into its carried left sibling there;
    ``keep_attention_outputs``: ours' checkpointed blocks keep the forward's attention outputs for the recompute)."""
    from ..model.diffusers_compat import diffusers_twin
    from ..model.init import build_model

    ours = build_model(arch, seed=0, runtime="strict", dtype=dtype, device=device)
    theirs = diffusers_twin(ours)
    lora = LoraConfig(rank=rank, alpha=float(rank), targets=list(LORA_TARGETS), init="random", seed=1)
    trained = ([ours] if {"ours", "ours_parked"} & set(names) else []) + ([theirs] if "diffusers_peft" in names else [])
    for model in trained:
        attach_lora(model, lora)
        model.requires_grad_(False)
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
    ours.enable_gradient_checkpointing(True, keep_attention_outputs=keep_attention_outputs)
    theirs.enable_gradient_checkpointing()
    theirs.train()
    if device == "cuda":
        ours.enable_cuda_graphs()
        ours.graph_cache.share_pool = ours.train_graphs.share_pools = shared_pools
        ours.train_graphs.fold_batches, ours.train_graphs.carry = fold_batches, carry
    what = "MMDiT strict" + (" + CUDA graphs" if device == "cuda" else "") + ", grad sink"
    engines = [Engine("diffusers_peft", theirs, Runtime.OFF, False, "diffusers QwenImageTransformer2DModel + PEFT, eager, autograd"),
               Engine("ours", ours, Runtime.STRICT, True, what),
               # the same model again with the fold's waiting nodes parked on the host: both ways in one process
               Engine("ours_parked", ours, Runtime.STRICT, True, what + ", fold nodes parked on the host",
                      park_fold_nodes=True)]
    return [e for e in engines if e.name in names]


def _fresh_graphs(model: torch.nn.Module) -> None:
    """Drop ``model``'s captured graphs (keeping how they share pools), so an engine that runs it after another does
    not replay the other's captures: each engine's timed update pays its own, as one run of ``train`` would."""
    fwd, train = getattr(model, "graph_cache", None), getattr(model, "train_graphs", None)
    if fwd is None or train is None:
        return
    model.enable_cuda_graphs()
    model.graph_cache.share_pool, model.train_graphs.share_pools = fwd.share_pool, train.share_pools
    model.train_graphs.fold_batches, model.train_graphs.carry = train.fold_batches, train.carry


def _train_phase(engine: Engine, up: Update, samples: EpochSamples) -> tuple[SampleGradSink | None, dict[str, Any]]:
    """Forward + loss + backward over every (sample, window step) pair, ``up.tcfg.micro_batch`` pairs at a time (or the
    engine's own micro-batch and CFG layout)."""
    scale = up.scfg.guidance_scale
    pairs = sorted(((n, s) for n in range(len(samples.sample_ids)) for s in samples.sde_steps[n]),
                   key=lambda p: pair_key(samples, p))
    mb = engine.micro_batch or up.tcfg.micro_batch
    layout = engine.cfg_layout or up.tcfg.cfg_layout
    batches = [pairs[i:i + mb] for i in range(0, len(pairs), mb)]
    keys = [grad_keys(samples, b, scale) for b in batches]
    # as train does under the strict runtime: the backward leaves autograd's sums out, the fold replaces them
    park = (HostPark.for_micro_batches(keys, engine.park_lookahead, engine.park_buffers)  # as train does
            if engine.park_fold_nodes else None)
    sink = SampleGradSink([k for ks in keys for k in ks], autograd_sums=False, park=park) if engine.grad_sink else None
    differ, exact = [], []
    trace = MemoryTrace(engine.model)
    with collect_sample_grads(sink) if sink is not None else contextlib.nullcontext(), side(engine.model, engine.runtime):
        for part, ks in zip(batches, keys):
            ev = evaluate_pairs(engine.model, samples, part, up.prompts, up.sigmas, up.grid, scale, layout,
                                up.scfg.noise_level)
            trace.mark("forward")
            old = torch.stack([samples.logp[s, n] for n, s in part])
            loss = grpo_loss(ev.logp, old, up.advantages[[n for n, _ in part]], 1.0 / len(pairs), up.tcfg.clip_range,
                             up.tcfg.adv_clip_max)
            loss.loss.backward()
            if sink is not None:
                sink.done(ks)
            trace.mark("backward")
            differ.append(logp_bytes_differ(ev.logp, old))
            exact.append(loss.ratio == 1.0)
    return sink, {"pairs": len(pairs), "micro_batches": len(batches), "logp_bytes_differ": int(torch.cat(differ).sum()),
                  "ratio_exact_one_frac": float(torch.cat(exact).double().mean()), "memory_trace": trace.rows}


class MemoryTrace:
    """Where a phase's allocated peak is reached (a model on a CUDA device only; else no rows): after each mark, the
    allocator's peak so far, what is allocated, and the model's training-graph captures so far. The figures are the
    allocator's host-side counters, read without a synchronisation, so marking costs no GPU time."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.rows: list[dict[str, Any]] = []
        # the model's device, not whether CUDA is initialised: a CPU run in a process that touched a GPU marks nothing
        self._on = next(model.parameters()).device.type == "cuda"

    def mark(self, what: str) -> None:
        if not self._on:
            return
        graphs = getattr(self.model, "train_graphs", None)
        self.rows.append({"at": what, "micro_batch": sum(r["at"] == "backward" for r in self.rows),
                          "peak_so_far_gib": torch.cuda.max_memory_allocated() / 2**30,
                          "allocated_gib": torch.cuda.memory_allocated() / 2**30,
                          "captures": None if graphs is None else graphs.captures})


def peak_reached(trace: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The first mark of a :class:`MemoryTrace` at which the peak so far equals the phase's (None without rows)."""
    if not trace:
        return None
    top = trace[-1]["peak_so_far_gib"]
    return next(r for r in trace if r["peak_so_far_gib"] >= top)


def _optimizer_phase(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, sink: SampleGradSink | None,
                     max_norm: float) -> None:
    """(The sink's fold into ``.grad``,) gradient clipping, one AdamW step, gradients dropped."""
    if sink is not None:
        for p in params:
            folded = sink.fold(p)
            if folded is None and p.grad is None:  # no path to the loss (the last block's text stream)
                continue
            if folded is None:
                raise RuntimeError(f"the strict backward deposited no per-sample partial for a LoRA tensor of shape "
                                   f"{tuple(p.shape)}: its gradient would be autograd's sum, not the sink's fold")
            p.grad = folded.to(p.dtype)
    torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _measure(fn: Callable[[], Any], device: torch.device, profile: bool) -> tuple[Any, dict[str, Any]]:
    """``fn()`` and its wall seconds and memory (CUDA: synchronised; ``profile``: its :class:`GpuProfile` too)."""
    cuda = device.type == "cuda"
    row: dict[str, Any] = {"start_gib": None, "peak_gib": None, "peak_reserved_gib": None}
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the reserved peak then counts what this phase holds, not an earlier engine's cache
        torch.cuda.reset_peak_memory_stats(device)
        row["start_gib"] = torch.cuda.memory_allocated(device) / 2**30
    t0 = time.perf_counter()
    out, prof = gpu_profile(fn) if profile else (fn(), None)
    if cuda:
        torch.cuda.synchronize(device)
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        # what the process holds: a CUDA graph's pool keeps the blocks its capture freed, which "allocated" omits
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    row["wall_s"] = time.perf_counter() - t0
    if prof is not None:
        row.update(launches=prof.device_events, host_launches=prof.host_launches or None, gpu_s=prof.device_s)
    return out, row


def one_update(engine: Engine, up: Update, opt: torch.optim.Optimizer, params: list[torch.nn.Parameter],
               device: torch.device, profile: bool = False) -> dict[str, Any]:
    """Rollout, train and optimizer phases of one update; per phase its measurements, plus the train phase's checks."""
    if engine.release_training_graphs:
        release_training_graphs(engine.model)  # as train does before its rollout with train.release_training_graphs
    samples, roll = _measure(lambda: rollout_epoch(engine.model, engine.runtime, up.prompts, up.sigmas, up.grid, up.scfg,
                                                   SEED, 0), device, profile)
    release_forward_graphs(engine.model)  # as train does after its rollout (ours: the rollout's captured forwards)
    (sink, checks), train = _measure(lambda: _train_phase(engine, up, samples), device, profile)
    trace = checks.pop("memory_trace")
    held = memory_held(engine.model, sink, params)
    _, step = _measure(lambda: _optimizer_phase(params, opt, sink, up.tcfg.max_grad_norm), device, profile)
    return {"phases": {"rollout": roll, "train": train, "optimizer": step}, "checks": checks, "held": held,
            "memory_trace": trace}


def memory_held(model: torch.nn.Module, sink: SampleGradSink | None, params: list[torch.nn.Parameter]) -> dict[str, Any]:
    """What ours holds at the end of the train phase beside the weights (GiB): the grad sink's buffered partials at
    their fullest and its open fold nodes (each an FP32 copy of the LoRA), the captured training steps' memory pools
    and shared partial buffers. Empty for an engine without a sink."""
    if sink is None:
        return {}
    stats = sink.stats
    lora_fp32 = sum(p.numel() for p in params) * 4 / 2**30
    graphs = getattr(model, "train_graphs", None)
    park = sink.park
    return {"lora_fp32_gib": lora_fp32, "sink_peak_pending_gib": stats.peak_pending_bytes / 2**30,
            "parked_peak_host_gib": None if park is None else park.stats.peak_host_bytes / 2**30,
            "parked_nodes": None if park is None else park.stats.parks,
            # where the park's host time goes: pinned allocations (within parks), parks, copies back
            "park_host_s": None if park is None else {k: getattr(park.stats, k) for k in ("host_alloc_s", "park_s", "back_s")},
            # host buffers made and handed out again, all updates so far (kept from one update to the next)
            "park_buffers": None if park is None else {"allocated": park.buffers.allocated, "reused": park.buffers.reused},
            "sink_peak_nodes_per_param": stats.peak_nodes_per_param,
            "sink_group_tensors": stats.group_tensors,  # tensors folded as one group from the captured steps' flat buffers
            "sink_host_s": stats.host_seconds,  # host time in the sink's calls in the train phase (its fold comes later)
            "cuda_graphs_so_far": graph_stats(model),  # captures / replays since the engine was built, warm-up included
            "train_graph_instances": None if graphs is None else len(graphs),
            "train_graph_pools": None if graphs is None else graphs.pools(),
            "partial_arena_gib": None if graphs is None else graphs.arena_bytes() / 2**30,
            **cuda_pools_gib()}


def cuda_pools_gib() -> dict[str, Any]:
    """What the CUDA caching allocator holds now, by pool (GiB): the default pool's reserved and allocated bytes, and
    the CUDA-graph pools' reserved bytes, which ``max_memory_allocated`` does not see between replays (a graph's
    intermediates live in its pool). Empty without CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    default = [0, 0]
    graphs: dict[tuple[int, int], int] = {}
    for seg in torch.cuda.memory_snapshot():
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        if pool == (0, 0):
            default[0] += seg.get("total_size", 0)
            default[1] += seg.get("allocated_size", 0)
        else:
            graphs[pool] = graphs.get(pool, 0) + seg.get("total_size", 0)
    return {"default_pool_reserved_gib": default[0] / 2**30, "default_pool_allocated_gib": default[1] / 2**30,
            "graph_pools_reserved_gib": sum(graphs.values()) / 2**30, "graph_pools": len(graphs)}


def run_engine(engine: Engine, ups: Sequence[Update], device: torch.device, warmup: int, bar: tqdm,
               profile: bool = True) -> dict[str, Any]:
    """``warmup`` untimed updates, the timed one, and on CUDA with ``profile`` the profiled one (update ``k`` runs
    ``ups[k]``, the last one where there are fewer); the engine's report row."""
    _fresh_graphs(engine.model)
    named = sorted(((n, p) for n, p in engine.model.named_parameters() if p.requires_grad), key=lambda t: t[0])
    params = [p for _, p in named]
    opt, _ = build_optimizer(params, ups[0].tcfg)
    runs = []
    profiled = profile and device.type == "cuda"
    for k, kind in enumerate(["warmup"] * warmup + ["timed"] + (["profiled"] if profiled else [])):
        bar.set_postfix_str(f"{engine.name} {kind}")
        runs.append(one_update(engine, ups[min(k, len(ups) - 1)], opt, params, device, profile=kind == "profiled"))
        bar.update(1)
    timed, first = runs[warmup], runs[0]["checks"]
    phases = timed["phases"]
    prof = runs[-1]["phases"] if profiled else None
    for name, row in phases.items():
        row.update(launches=None, host_launches=None, gpu_busy=None)
        if prof is not None:
            row.update(launches=prof[name]["launches"], host_launches=prof[name]["host_launches"],
                       gpu_busy=prof[name]["gpu_s"] / row["wall_s"], profiled_wall_s=prof[name]["wall_s"])
    total = {"wall_s": sum(r["wall_s"] for r in phases.values()),
             "peak_gib": None if device.type != "cuda" else max(r["peak_gib"] for r in phases.values()),
             "peak_reserved_gib": None if device.type != "cuda" else max(r["peak_reserved_gib"] for r in phases.values()),
             "launches": None if prof is None else sum(r["launches"] for r in phases.values()),
             "gpu_busy": None if prof is None else sum(p["gpu_s"] for p in prof.values()) / sum(r["wall_s"] for r in phases.values())}
    return {"engine": engine.what, "runtime": engine.runtime.value, "phases": phases, "total": total,
            "lora_tensors": len(params), "held_after_train": timed["held"], **timed["checks"],
            # the timed train phase's allocated memory after each micro-batch's forward and backward, and where it peaked
            "train_memory_trace": timed["memory_trace"], "train_peak_reached": peak_reached(timed["memory_trace"]),
            "first_update_logp_bytes_differ": first["logp_bytes_differ"],
            "first_update_ratio_exact_one": first["logp_bytes_differ"] == 0 and first["ratio_exact_one_frac"] == 1.0,
            "checks_every_update": [r["checks"] for r in runs]}


def ratios(engines: dict[str, Any], ours: str = "ours", theirs: str = "diffusers_peft") -> dict[str, dict[str, float | None]]:
    """Ours / theirs per phase (and ``total``) for wall, peak memory, launches and GPU busy; None where either is missing."""
    if "phases" not in engines.get(ours, {}) or "phases" not in engines.get(theirs, {}):
        return {}
    a, b = engines[ours], engines[theirs]
    out = {}
    for phase in [*PHASES, "total"]:
        ra, rb = (a["total"], b["total"]) if phase == "total" else (a["phases"][phase], b["phases"][phase])
        out[phase] = {k: (ra[k] / rb[k] if ra.get(k) is not None and rb.get(k) else None)
                      for k in ("wall_s", "peak_gib", "peak_reserved_gib", "launches", "gpu_busy")}
    return out


def all_ratios(engines: dict[str, Any]) -> dict[str, Any]:
    """The report's ratio sections: ``ratios`` (ours / theirs) and, where ``ours_parked`` ran, ``ratios_parked``."""
    out: dict[str, Any] = {"ratios": ratios(engines)}
    if "ours_parked" in engines:
        out["ratios_parked"] = ratios(engines, ours="ours_parked")
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build both engines on one set of weights, run each one's updates, return the report (no environment)."""
    arch = preset(args.arch)
    if args.layers is not None:
        arch = dataclasses.replace(arch, num_layers=args.layers)
    device = torch.device(args.device)
    dtype_name = "bfloat16" if device.type == "cuda" else "float32"  # the CPU strict backend computes in FP32
    dtype = DTYPES[dtype_name]
    grid = (int(args.grid[0]), int(args.grid[1]))
    engines = build_engines(arch, args.device, dtype, args.lora_rank, args.graph_pools == "shared", args.fold_batches,
                            args.keep_attention_outputs, args.engines, args.carry_fold_nodes)
    for e in engines:
        e.park_fold_nodes = e.park_fold_nodes or (e.name == "ours" and args.park_fold_nodes)
        e.park_lookahead = args.park_lookahead
        if e.grad_sink:  # ours (and ours_parked): the split and layout do not change its bytes
            e.micro_batch, e.cfg_layout = args.ours_micro_batch, args.ours_cfg_layout
            e.release_training_graphs = args.release_training_graphs
    shortest = args.txt if args.prompts == 1 and not args.fresh_prompts else max(1, args.txt // 2)

    def draw(seed: int) -> Prompts:
        return make_prompts(PromptsConfig(num_prompts=args.prompts, min_tokens=shortest, max_tokens=args.txt,
                                          negative_tokens=max(1, args.txt // 2), seed=seed), arch, args.device, dtype_name)

    prompts = draw(0)
    scfg = SampleConfig(num_steps=args.steps, noise_level=ETA, guidance_scale=CFG_SCALE, num_image_per_prompt=args.group,
                        prompts_per_epoch=args.prompts, batch_size=args.group, cfg_layout=args.cfg_layout,
                        sde_window_size=args.window, runtime=None)
    tcfg = TrainConfig(micro_batch=args.micro_batch, cfg_layout=args.cfg_layout)
    # fixed rewards 0 .. G-1 in every group; the samples run group by group
    groups = [g for g in range(args.prompts) for _ in range(args.group)]
    adv, _ = StatTracker().advantages(torch.arange(args.group, dtype=torch.float64).repeat(args.prompts), groups)
    up = Update(prompts, sigma_table(args.steps, grid[0] * grid[1]), grid, scfg, tcfg, adv.to(device=device, dtype=torch.float32))
    # --fresh-prompts: every update draws its own prompts (other lengths: new batch layouts to capture, as each epoch of
    # train meets), so the warm-up compiles kernels without capturing what the timed update runs. The timed and
    # profiled updates draw seeds 0 and 1 whatever the warm-up count, so runs with other warm-ups time the same update
    seeds = [*(2 + k for k in range(args.warmup)), 0, 1]
    ups = [up] if not args.fresh_prompts else [up if s == 0 else dataclasses.replace(up, prompts=draw(s)) for s in seeds]
    tokens = [[int(e.shape[0]) for e in u.prompts.embeds] for u in ups]
    results: dict[str, Any] = {}
    errors = []
    per_engine = args.warmup + 1 + (device.type == "cuda" and args.profile)
    with tqdm(total=len(engines) * per_engine, desc="bench train", unit="update") as bar:
        for engine in engines:
            try:
                results[engine.name] = run_engine(engine, ups, device, args.warmup, bar, args.profile)
            except Exception as exc:  # an engine that cannot run here: record why and go on
                results[engine.name] = {"engine": engine.what, "error": f"{type(exc).__name__}: {exc}"[:400]}
                errors.append(f"{engine.name}: {results[engine.name]['error']}")
    config = {"arch": args.arch, "layers": arch.num_layers, "grid": list(grid), "txt": args.txt, "negative_txt": max(1, args.txt // 2),
              "prompts": args.prompts, "prompt_tokens": tokens[-2:] if args.fresh_prompts else tokens,
              "warmup_prompt_tokens": tokens[:-2] if args.fresh_prompts else [],
              "fresh_prompts": bool(args.fresh_prompts),
              "group": args.group, "steps": args.steps, "window": args.window, "micro_batch": args.micro_batch,
              "lora_rank": args.lora_rank, "lora_targets": list(LORA_TARGETS), "device": args.device, "dtype": str(dtype),
              "cfg_scale": CFG_SCALE, "eta": ETA, "cfg_layout": args.cfg_layout, "warmup": args.warmup, "profile": args.profile,
              "graph_pools": args.graph_pools, "park_fold_nodes": args.park_fold_nodes,
              "park_lookahead": args.park_lookahead, "fold_batches": args.fold_batches,
              "carry_fold_nodes": args.carry_fold_nodes,
              "keep_attention_outputs": args.keep_attention_outputs, "release_training_graphs": args.release_training_graphs,
              "ours_micro_batch": args.ours_micro_batch, "ours_cfg_layout": args.ours_cfg_layout,
              "grad_checkpointing": True, "clip_range": tcfg.clip_range, "learning_rate": tcfg.learning_rate}
    return {"config": config, "engines": results, **all_ratios(results), "errors": errors}


#: Settings that may differ between the runs :func:`merge_reports` joins (each engine keeps its own).
PER_RUN = ("warmup", "profile", "warmup_prompt_tokens")
#: Settings only our engines read: compared between the runs that hold one of ours, ignored in a run of the peer alone.
OURS_ONLY = ("park_lookahead", "fold_batches", "carry_fold_nodes", "keep_attention_outputs", "ours_micro_batch",
             "ours_cfg_layout", "release_training_graphs")
#: What must match in the runs' environments: one machine and one version of the code.
SAME_ENVIRONMENT = ("gpu", "driver", "torch", "triton", "cuda", "commit", "cpu")


def merge_reports(paths: Sequence[str | Path]) -> dict[str, Any]:
    """One report from ``bench train`` runs of different engines on the same setup (e.g. one engine per GPU call
    where both do not fit one): their engines side by side, the ratios recomputed. Refuses runs whose setup (all of
    ``config`` but :data:`PER_RUN`; :data:`OURS_ONLY` only among the runs that hold one of our engines) or environment
    (:data:`SAME_ENVIRONMENT`) differ, or that share an engine, naming what differs. Each engine keeps its run's
    :data:`PER_RUN` settings; ``merged_from`` lists the runs."""
    if len(paths) < 2:
        raise ValueError("--merge needs at least two train_bench.json reports")
    runs = []
    for path in paths:
        try:
            runs.append((str(path), json.loads(Path(path).read_text())))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--merge: cannot read {path}: {exc}") from exc
    (first, base), engines, errors, merged_from = runs[0], {}, [], []
    for path, rep in runs:
        if not {"config", "engines", "environment"} <= set(rep):
            raise ValueError(f"--merge: {path} is not a bench train report (no config, engines or environment)")
    ours = [(path, rep) for path, rep in runs if any(n.startswith("ours") for n in rep["engines"])]
    ours_first, ours_base = ours[0] if ours else (first, base)
    for path, rep in runs:
        differ = sorted(k for k in set(base["config"]) | set(rep["config"])
                        if k not in PER_RUN and k not in OURS_ONLY and base["config"].get(k) != rep["config"].get(k))
        if differ:
            raise ValueError(f"--merge: {path} ran another setup than {first}: {', '.join(differ)} differ")
        differ = [k for k in OURS_ONLY if ours_base["config"].get(k) != rep["config"].get(k)]
        if differ and any(path == p for p, _ in ours):
            raise ValueError(f"--merge: {path} ran our engines otherwise than {ours_first}: {', '.join(differ)} differ")
        env_differ = [k for k in SAME_ENVIRONMENT if base["environment"].get(k) != rep["environment"].get(k)]
        if env_differ:
            raise ValueError(f"--merge: {path} ran elsewhere than {first}: {', '.join(env_differ)} differ")
        for name, e in rep["engines"].items():
            if name in engines:
                raise ValueError(f"--merge: engine {name} is in more than one report ({path})")
            engines[name] = {**e, **{k: rep["config"].get(k) for k in PER_RUN}}
        errors += rep.get("errors", [])
        merged_from.append({"report": path, "engines": list(rep["engines"]), "date_utc": rep["environment"].get("date_utc"),
                            "wall_s": rep.get("wall_s"), **{k: rep["config"].get(k) for k in PER_RUN}})
    config = {**base["config"], **{k: ours_base["config"].get(k) for k in OURS_ONLY}}
    for k in PER_RUN:
        values = {name: e[k] for name, e in engines.items()}
        config[k] = next(iter(values.values())) if len(set(map(str, values.values()))) == 1 else \
            ", ".join(f"{name} {v}" for name, v in values.items())
    walls = [m["wall_s"] for m in merged_from]
    return {"config": config, "engines": engines, **all_ratios(engines), "errors": errors,
            "environment": base["environment"], "merged_from": merged_from,
            # the runs' processes one after another (None when a run did not record its own)
            "wall_s": None if None in walls else sum(walls)}


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def _sink_options(c: dict[str, Any]) -> str:
    """The setup sentence's clause on how ours folds, parks and keeps its captured steps (empty at the defaults)."""
    said = [text for key, text in (("fold_batches", "folds each captured forward's keys inside its backward"),
                                   ("carry_fold_nodes", "carries a left node into its sibling's step"),
                                   ("release_training_graphs", "drops its training captures before each rollout"))
            if c.get(key)]
    if c.get("park_lookahead") is not None:
        said.append(f"parks with a lookahead of {c['park_lookahead']} keys (ours_parked)")
    return f" Ours {', '.join(said[:-1])}{' and ' if len(said) > 1 else ''}{said[-1]}." if said else ""


def render(report: dict[str, Any]) -> str:
    """The Markdown report: setup, one row per engine and phase, ours / theirs ratios, the on-policy check."""
    c, env = report["config"], report["environment"]
    lines = [f"# One Flow-GRPO update: ours vs diffusers + PEFT ({c['arch']}, {c['layers']} blocks, grid {c['grid']})", "",
             environment_line(env), "",
             f"{c.get('prompts', 1)} prompt(s) of {c.get('prompt_tokens', [[c['txt']]])} tokens (per update"
             f"{', drawn afresh for each' if c.get('fresh_prompts') else ''}), group G = {c['group']}, "
             f"S = {c['steps']} steps with CFG {c['cfg_scale']} ({c['cfg_layout']}), SDE window W = {c['window']}, "
             f"{c.get('prompts', 1) * c['group'] * c['window']} pairs in micro-batches of {c['micro_batch']}; LoRA rank "
             f"{c['lora_rank']} on {len(c['lora_targets'])} targets, gradient checkpointing, {c['dtype']}, "
             f"{c['warmup']} untimed warm-up update(s). Same base weights (one storage), same LoRA init."
             + (f" Ours trains in micro-batches of {c.get('ours_micro_batch') or c['micro_batch']} with CFG "
                f"{c.get('ours_cfg_layout') or c['cfg_layout']} (its gradient bytes do not depend on either)."
                if c.get("ours_micro_batch") or c.get("ours_cfg_layout") else "")
             + (" Ours recomputes attention in its checkpointed blocks (--no-keep-attention-outputs)."
                if c.get("keep_attention_outputs") is False else "") + _sink_options(c), ""]
    if report.get("merged_from"):
        lines += ["Merged from runs of one setup on one machine, one process each (`bench train --merge`): " +
                  "; ".join(f"{', '.join(m['engines'])} ({m.get('date_utc') or '—'})" for m in report["merged_from"]) +
                  ". Each process builds the same seeded random weights; the ratios compare runs, not one process.", ""]
    rows = []
    for name, e in report["engines"].items():
        if "error" in e:
            rows.append(md.row(name, "error", e["error"][:160], "", "", "", ""))
            continue
        for phase, r in [*e["phases"].items(), ("total", e["total"])]:
            rows.append(md.row(name, phase, _fmt(r["wall_s"]), _fmt(r["peak_gib"], ".1f"),
                               _fmt(r.get("peak_reserved_gib"), ".1f"), _fmt(r.get("launches"), "d"),
                               _fmt(r.get("host_launches"), "d"), _fmt(r.get("gpu_busy"), ".2f")))
    lines += md.section("Per phase", ["engine", "phase", "wall s", "peak GiB", "peak reserved GiB", "GPU launches",
                                      "host launches", "GPU busy / wall"],
                        rows, notes=["GPU launches: kernels, copies and fills the profiler saw on the GPU (a CUDA-graph "
                                     "replay counts each kernel); host launches: launch calls the host made (a replay counts "
                                     "once); GPU busy: the profiled update's GPU time over the timed update's wall. "
                                     "The optimizer phase of ours includes the gradient sink's fold. Peak GiB: tensors "
                                     "allocated; peak reserved: the allocator's memory, which also holds what CUDA-graph "
                                     "pools keep between replays."])
    for key, title in (("ratios", "Ours / theirs"), ("ratios_parked", "Ours with parked fold nodes / theirs")):
        rows = [md.row(phase, *(_fmt(r.get(k), ".2f") for k in ("wall_s", "peak_gib", "peak_reserved_gib", "launches",
                                                               "gpu_busy")))
                for phase, r in report.get(key, {}).items()]
        if rows:  # both sides ran
            lines += md.section(title, ["phase", "wall", "peak memory", "peak reserved", "GPU launches", "GPU busy"], rows)
    held = [md.row(name, *(_fmt(h.get(k), ".2f") for k in ("lora_fp32_gib", "sink_peak_pending_gib")),
                   *(_fmt(h.get(k), "d") for k in ("sink_peak_nodes_per_param", "sink_group_tensors",
                                                    "train_graph_instances", "train_graph_pools")),
                   _fmt(h.get("partial_arena_gib"), ".2f"), _fmt(h.get("parked_peak_host_gib"), ".2f"),
                   _fmt(h.get("sink_host_s"), ".2f"),
                   _captures((h.get("cuda_graphs_so_far") or {}).get("training")))
            for name, e in report["engines"].items() if (h := e.get("held_after_train"))]
    if held:
        lines += md.section("What the grad sink and the captured steps held (timed update)",
                            ["engine", "LoRA, FP32 GiB", "sink partials at fullest GiB", "open fold nodes per tensor",
                             "tensors folded as one", "captured steps", "their memory pools", "shared partial buffers GiB",
                             "parked on the host at most GiB", "sink host s", "training captures / replays / uncaptured so far"],
                            held,
                            notes=["Each open fold node is one more FP32 copy of the LoRA (on the device unless parked on "
                                   "the host: --park-fold-nodes); tensors folded as one: the captured steps hand the sink "
                                   "every tensor's partials in flat buffers, folded (and parked) with one operation for "
                                   "all of them; sink host s: the host's time in the sink's calls in the train phase "
                                   "(launching its copies, sums and parks); the pools hold the captured steps' activations and "
                                   "temporaries (instances never live together share one)."])
    pools = [md.row(name, *(_fmt(h.get(k), ".2f") for k in ("default_pool_reserved_gib", "default_pool_allocated_gib",
                                                             "graph_pools_reserved_gib")),
                    _fmt(h.get("graph_pools"), "d"),
                    *(_fmt((h.get("park_host_s") or {}).get(k), ".2f") for k in ("host_alloc_s", "park_s", "back_s")))
             for name, e in report["engines"].items() if (h := e.get("held_after_train")) and "graph_pools" in h]
    if pools:
        lines += md.section("The CUDA allocator's pools at the end of the train phase, and the park's host time",
                            ["engine", "default pool reserved GiB", "default pool allocated GiB", "graph pools reserved GiB",
                             "graph pools", "pinned allocations s", "parks s", "copies back s"], pools,
                            notes=["A captured step's activations and temporaries live in its graph pool: reserved, and "
                                   "not in the peak allocated figures above. The park's times are host times of its calls "
                                   "(the pinned allocations are part of the parks')."])
    reached = [md.row(name, f"{r['micro_batch']} of {e['micro_batches']}", r["at"], _fmt(r["peak_so_far_gib"], ".2f"),
                      _fmt(r["allocated_gib"], ".2f"), _fmt(r["captures"], "d"),
                      _fmt(e["train_memory_trace"][-1]["captures"], "d"))
               for name, e in report["engines"].items() if (r := e.get("train_peak_reached"))]
    if reached:
        lines += md.section("Where the timed train phase reached its allocated peak",
                            ["engine", "micro-batch", "after its", "peak GiB", "allocated then GiB",
                             "training captures by then", "at the phase's end"], reached,
                            notes=["The first micro-batch (counted from 0) after whose forward or backward the "
                                   "allocator's peak equals the phase's; captures: the engine's training-step captures "
                                   "since it was built (—: none kept)."])
    checks = [md.row(name, e["first_update_logp_bytes_differ"], e["pairs"], "yes" if e["first_update_ratio_exact_one"] else "no")
              for name, e in report["engines"].items() if "error" not in e]
    lines += md.section("On-policy check (first update)", ["engine", "pairs whose logp bytes differ from the rollout's",
                                                           "pairs", "every ratio exactly 1"], checks)
    return "\n".join(lines + md.errors_and_wall_time(report)) + "\n"


def _captures(stats: dict[str, int] | None) -> str:
    return "—" if not stats else f"{stats['captures']} / {stats['replays']} / {stats['uncaptured']}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mmdit_strict.bench.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="experiments/local", help="output folder")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when there is a GPU, else cpu")
    p.add_argument("--arch", choices=sorted(SIZES), default=None, help="default: qwen-image on cuda, tiny on the CPU")
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (default: the architecture's, 60 for Qwen-Image)")
    p.add_argument("--grid", type=int, nargs=2, default=None, help="latent grid in tokens (default 64 64 = 1024², tiny 4 4)")
    p.add_argument("--txt", type=int, default=None, help="prompt tokens (default 128, tiny 8); the negative prompt has half")
    p.add_argument("--prompts", type=int, default=1,
                   help="prompts per update, each with its own group (several: lengths drawn in [L/2, L])")
    p.add_argument("--fresh-prompts", action="store_true",
                   help="each update draws its own prompts (new batch layouts, captured in the timed update as in an epoch)")
    p.add_argument("--group", type=int, default=2, help="samples of each prompt (the GRPO group)")
    p.add_argument("--steps", type=int, default=10, help="sampling steps of the rollout")
    p.add_argument("--window", type=int, default=2, help="SDE window: the steps trained on")
    p.add_argument("--micro-batch", type=int, default=2, help="(sample, step) pairs per training forward")
    p.add_argument("--lora-rank", type=int, default=None, help="default 64, tiny 4")
    p.add_argument("--cfg-layout", choices=["sequential", "batched"], default="sequential",
                   help="CFG of both engines in both phases (sequential: two forwards, as QwenImagePipeline)")
    p.add_argument("--warmup", type=int, default=1, help="untimed updates per engine before the timed one")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA: a profiled update per engine after the timed one, for launches and GPU busy (--no-profile "
                        "skips it: those columns stay empty; the profiled peer update takes about 4x its timed one)")
    p.add_argument("--engines", nargs="+", choices=["diffusers_peft", "ours", "ours_parked"],
                   default=["diffusers_peft", "ours"],
                   help="engines to run, in this order: the peer, ours, and ours again with train.park_fold_nodes=true "
                        "(default the first two; the ratios need the peer)")
    p.add_argument("--park-fold-nodes", action="store_true",
                   help="ours: the grad sink's waiting fold nodes in pinned host memory (train.park_fold_nodes=true)")
    p.add_argument("--park-lookahead", type=int, default=None, metavar="KEYS",
                   help="parked engines: keys before a parked node's join at which its copy back starts "
                        "(train.park_lookahead; default one micro-batch's keys, 0: each node comes back at its join)")
    p.add_argument("--keep-attention-outputs", action=argparse.BooleanOptionalAction, default=True,
                   help="ours: checkpointed blocks keep the forward's attention outputs for the recompute "
                        "(train.keep_attention_outputs; --no-keep-attention-outputs recomputes them: less memory)")
    p.add_argument("--release-training-graphs", action="store_true",
                   help="ours: drop the captured training steps (their pool, the shared partial buffers) before each "
                        "rollout (train.release_training_graphs=true): less memory in the rollout, layouts captured again")
    p.add_argument("--graph-pools", choices=["shared", "per-instance"], default="shared",
                   help="ours on CUDA: captured graphs share memory pools as the model does by default, or each has its own")
    p.add_argument("--ours-micro-batch", type=int, default=None,
                   help="ours (and ours_parked) train with this many pairs per forward instead of --micro-batch (their "
                        "gradient bytes do not depend on it; the peer keeps --micro-batch)")
    p.add_argument("--ours-cfg-layout", choices=["sequential", "batched"], default=None,
                   help="ours (and ours_parked) run the training forwards' CFG in this layout instead of --cfg-layout")
    p.add_argument("--fold-batches", action="store_true",
                   help="ours: a captured training step whose keys are one node of the grad sink's tree folds its batch in "
                        "the graph (train.fold_captured_batches=true; with --cfg-layout batched, micro-batches of 2^k pairs)")
    p.add_argument("--carry-fold-nodes", action="store_true",
                   help="ours, with --fold-batches: a captured step that is a left child node leaves it in the shared "
                        "partial buffer for its sibling's step to add into (train.carry_fold_nodes=true; same bytes)")
    p.add_argument("--replot", default=None, metavar="REPORT.json",
                   help="redraw a written report's figure (REPORT.png beside it); runs nothing, needs no GPU")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="join train_bench.json reports of different --engines runs of one setup on one machine into one "
                        "report in --out (ratios recomputed); runs nothing")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.replot:
        return replot(args.replot, plot, "bench.train", "no engine with phase timings")
    if args.merge:
        try:
            report = merge_reports(args.merge)
        except ValueError as exc:
            p.error(str(exc))
        return _write(args.out, report)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.arch = args.arch or ("qwen-image" if args.device == "cuda" else "tiny")
    sizes = SIZES[args.arch]
    args.grid = args.grid or sizes["grid"]
    args.txt = args.txt if args.txt is not None else sizes["txt"]
    args.lora_rank = args.lora_rank if args.lora_rank is not None else sizes["lora_rank"]
    try:
        check_args(args)
    except ValueError as exc:
        p.error(str(exc))
    t0 = time.perf_counter()
    report = run(args)
    report["environment"] = run_environment(args.device)
    report["wall_s"] = time.perf_counter() - t0
    return _write(args.out, report)


def _write(out: str, report: dict[str, Any]) -> int:
    """The report's JSON and markdown (printed), and its figure (``train_bench.png``) where an engine has timings."""
    print(write_report(out, "train_bench", report, render))
    plot(report, Path(out) / "train_bench.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

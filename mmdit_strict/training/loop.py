"""Flow-GRPO training of the policy's LoRA: build → per epoch (rollout → rewards → advantages → updates) → log / checkpoint.

Per epoch ``e``:

1. **rollout** (no grad, ``sample.runtime``): ``prompts_per_epoch`` prompts × ``num_image_per_prompt``
   images, SDE on each group's window of steps, ODE elsewhere; every SDE step's ``logp`` is recorded.
2. **rewards** on the final latents; **advantages** from the stat tracker.
3. **train** (``train.runtime``), ``num_inner_epochs`` times: the (sample, train step) pairs, shuffled
   with a key of (seed, epoch, inner epoch), are cut into optimizer updates of
   ``micro_batch × gradient_accumulation_steps`` pairs, each update into micro-batches of
   ``micro_batch`` pairs (in gradient-key order first with ``train.sort_update_pairs``, the default). The **old
   logp is the rollout's recorded logp**: with strict rollout == strict training the first update's
   ratios are exactly 1.0. LoRA gradients are folded through the grad sink in global
   (sample, step, branch) order, so they are the same bytes for every micro-batch split; a backend
   that deposits no per-sample partials (``runtime=off``) falls back to autograd's sum and the epoch
   row says so (``grad_fold``). With ``train.grad_sink=streamed`` the sink is told the update's keys
   up front and folds each partial as soon as its predecessors are in; the micro-batches run in order
   of their smallest key (their composition unchanged), which bounds what it buffers
   (``grad_sink_*`` in the epoch row).
4. **checkpoint** every ``save_freq`` epochs; **eval** every ``eval_freq`` epochs with the ODE sampler.

With edit conditioning (``prompts.edit``) the input image belongs to the prompt: every sample of a group,
in the rollout, in each policy forward of the updates and in the evaluation, carries its prompt's
conditioning latents through :func:`~mmdit_strict.trajectories.engine.velocity` (the main job's path), so
a micro-batch may mix conditioning sizes; rewards score the noisy latents alone.

Under ``torchrun`` (docs/distributed.md, "Training") every rank rolls out a contiguous block of the
epoch's samples and all ranks gather them; rank 0 computes rewards, advantages and evaluations and
moves them to the others; each optimizer update's pairs, sorted by gradient key, are cut into one
contiguous block per rank, and the ranks merge their gradient-tree nodes
(:func:`~mmdit_strict.distributed.fold.merge_update`) into the single-process gradient bytes, so every
rank takes the same optimizer step. Rank 0 alone writes the folder.

Every random choice is keyed (see :mod:`.rollout`), so ``resume=true`` after a kill redoes the
unfinished epoch and ends on the same LoRA bytes as an uninterrupted run.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from .. import distributed
from ..config.compose import save_resolved
from ..config.schema import DistributedConfig, LoraConfig, ModelConfig, PromptsConfig, TrainRunConfig, section_names, to_typed
from ..distributed import layout
from ..distributed.fold import merge_update, range_nodes
from ..config.training import SampleConfig, TrainConfig
from ..kernels.fold_park import HostBuffers, HostPark
from ..kernels.grad_sink import (
    SampleGradSink,
    collect_sample_grads,
    execution_order,
    pending_bound,
)
from ..kernels.runtime import Runtime
from ..model.graphs import graph_stats, release_forward_graphs, release_training_graphs
from ..parallel import ModelLayout, model_parallel
from ..parallel import build as build_model_parallel
from ..sampling import sigma_table
from ..trajectories.outdir import claim_output_dir
from ..trajectories.setup import DTYPES, build_side_model, latent_grid, make_prompts, resolve_runtime
from . import checkpoint as ckpt
from .advantages import StatTracker
from .checkpoint_writer import CheckpointWriter
from .export import export_lora
from .loss import grpo_loss, logp_bytes_differ
from .metrics import MetricLogger, peak_resident_set_mb, plot_epoch_costs, plot_rewards, read_metrics, take_cuda_peaks
from .optim import LoraEMA, build_optimizer
from .policy import adapters_disabled, cfg_branches, evaluate_pairs, grad_keys, pair_key
from .rewards import ImageSource, RewardSet
from .state import state_digest
from .rollout import EpochSamples, ode_sample, rollout_epoch, side

logger = logging.getLogger(__name__)

#: Initial-latent ids of the evaluation samples (far above any training sample id).
EVAL_ID_BASE = 1 << 40

#: Keys of the ``train`` schema (:class:`~mmdit_strict.config.schema.TrainRunConfig`) that may change between a
#: run and its resume: they decide neither the bytes of the LoRA nor the order of the work. Every other key of
#: the schema must match the checkpoint's.
RESUME_FREE = ("resume", "progress", "wandb", "output_dir", "_choices_", "train.num_epochs", "train.eval_freq",
               "train.save_freq", "train.export", "train.recompute_old_logp", "train.cpu_threads", "train.grad_sink",
               "train.keep_attention_outputs", "train.sort_update_pairs", "train.park_fold_nodes",
               "train.park_lookahead", "train.fold_captured_batches", "train.carry_fold_nodes", "train.release_training_graphs",
               "train.async_checkpoint", "distributed")

UpdateHook = Callable[[int, int, int], None]


class OldLogpMismatch(RuntimeError):
    """``train.recompute_old_logp``: the training side's logp is not the rollout's bytes."""


@dataclass
class TrainResult:
    """What a finished (or resumed and finished) run leaves behind."""

    out_dir: Path
    epochs: int
    metrics: list[dict[str, Any]]
    lora: dict[str, torch.Tensor]
    export: dict[str, Path] = field(default_factory=dict)
    wandb_error: str | None = None  # wandb failed when closing its run (the training itself finished)


def _flat(cfg: DictConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


def _resume_key(cfg: DictConfig) -> dict[str, Any]:
    """Every key of the composed ``train`` config but the :data:`RESUME_FREE` ones, flattened (``train.learning_rate``)."""
    return {k: v for k, v in _flat(cfg).items() if not any(k == f or k.startswith(f + ".") for f in RESUME_FREE)}


def resume_differences(now: dict[str, Any], then: dict[str, Any]) -> list[str]:
    """The keys whose values differ between two resume keys, sorted.

    Only sections of the ``train`` schema are compared: a checkpoint keyed by an older, wider schema
    (one that also held the trajectory commands' sections, which ``train`` never read) still resumes.
    """
    sections = set(section_names(TrainRunConfig))
    then = {k: v for k, v in then.items() if k.split(".")[0] in sections}
    return sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))


def train_steps_of(seed: int, sample_id: int, sde_steps: list[int], fraction: float) -> list[int]:
    """The keyed subset of a sample's SDE steps it trains on: ``max(1, int(len · fraction))`` steps."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"train.timestep_fraction must be in (0, 1], got {fraction}")
    k = max(1, int(len(sde_steps) * fraction))
    if k >= len(sde_steps):
        return list(sde_steps)
    return sorted(random.Random(f"steps|{seed}|{sample_id}").sample(list(sde_steps), k))


def prompt_texts(pcfg: PromptsConfig, n: int) -> list[str]:
    """The prompt strings rewards see: ``prompts.text``, the prompt file's recorded texts, else ``"prompt <i>"``."""
    texts = pcfg.text
    if not texts and pcfg.embeddings:
        from ..pipelines.encode import read_prompt_metadata

        texts = read_prompt_metadata(pcfg.embeddings).get("prompts")
    if texts and len(texts) == n:
        return [str(t) for t in texts]
    return [f"prompt {i}" for i in range(n)]


def image_source(mcfg: ModelConfig, rewards: RewardSet) -> ImageSource:
    """The VAE of ``model.checkpoint`` when it is a pipeline folder with one (and a reward wants images), else the preview."""
    from ..pipelines.chain import pipeline_folder
    from ..pipelines.vae import load_vae

    folder = pipeline_folder(mcfg.checkpoint)
    if folder is None or not any(s.takes == "images" for s in rewards.specs):
        return ImageSource()
    return ImageSource(load_vae(folder, device=mcfg.device, torch_dtype=DTYPES[mcfg.dtype]))


class Trainer:
    """One training run in ``cfg.output_dir`` (see the module docstring).

    ``cfg`` is a composed ``train`` config (:func:`~mmdit_strict.training.rewards.compose_train`), validated at compose
    time; the trainer reads its sections as typed objects (:class:`SampleConfig`, :class:`TrainConfig`,
    :class:`ModelConfig`, :class:`LoraConfig`).
    """

    def __init__(self, cfg: DictConfig, progress: bool = True, on_update: UpdateHook | None = None) -> None:
        self.cfg = cfg
        self.scfg: SampleConfig = to_typed(cfg.sample, SampleConfig)
        self.tcfg: TrainConfig = to_typed(cfg.train, TrainConfig)
        self.mcfg: ModelConfig = to_typed(cfg.model, ModelConfig)
        self.lcfg: LoraConfig = to_typed(cfg.lora, LoraConfig)
        self.dcfg: DistributedConfig = to_typed(cfg.distributed, DistributedConfig)
        self.session = distributed.current()
        self.root = distributed.is_root()
        self.progress = progress and self.root
        self.on_update = on_update
        self.out = Path(cfg.output_dir)
        self.seed: int = cfg.seed
        self.rewards = RewardSet(self.tcfg.reward_fn, self.tcfg.reward_kwargs)
        self.rollout_rt = resolve_runtime(self.scfg.runtime, cfg.runtime.mode)
        self.train_rt = resolve_runtime(self.tcfg.runtime, cfg.runtime.mode)
        if self.session is not None and self.train_rt is Runtime.OFF:
            raise ValueError("train under torchrun folds per-sample LoRA-gradient partials across ranks; train.runtime=off "
                             "deposits none (autograd's sums depend on the split): use strict or audit")
        self.rollout_layout = ModelLayout.from_config(self.scfg.parallel)  # the epoch rollout's model-parallel layout
        self.rollout_exchanges = 0
        if not self.rollout_layout.trivial:  # refused before any work without torchrun or on a world it does not fit
            build_model_parallel(self.rollout_layout)
        self.model = build_side_model(self.mcfg, self.lcfg, self.rollout_rt)
        if getattr(self.model, "train_graphs", None) is not None:
            self.model.train_graphs.fold_batches = self.tcfg.fold_captured_batches
            self.model.train_graphs.carry = self.tcfg.carry_fold_nodes
        self.model.enable_gradient_checkpointing(self.tcfg.grad_checkpointing,
                                                 keep_attention_outputs=self.tcfg.keep_attention_outputs)
        self.device = self.model.device
        self.prompts = make_prompts(cfg.prompts, self.model.config, self.mcfg.device, self.mcfg.dtype)
        self.prompt_texts = prompt_texts(cfg.prompts, len(self.prompts.embeds))
        if self.session is not None:  # torchrun: every rank built the same policy and prompts
            from ..trajectories.record import model_hashes

            distributed.agree("training model and prompts", {**model_hashes(self.model), **self.prompts.hashes()})
        self.grid = latent_grid(cfg.sampler, self.model.config)
        self.sigmas = sigma_table(self.scfg.num_steps, self.grid[0] * self.grid[1])
        self.named = sorted(((n, p) for n, p in self.model.named_parameters() if p.requires_grad), key=lambda t: t[0])
        self.params = [p for _, p in self.named]
        self.optimizer, self.scheduler = build_optimizer(self.params, self.tcfg)
        self.ema = LoraEMA(self.named, self.tcfg.ema_decay) if self.tcfg.ema else None
        self.tracker = StatTracker(self.tcfg.per_prompt_stat_tracking, self.tcfg.global_std)
        self.images = image_source(self.mcfg, self.rewards) if self.root else ImageSource()  # rank 0 scores
        self.start_epoch = 0
        self.updates = 0
        self.wandb_id: str | None = None
        self._warned_fold = False
        self.ckpt_root = self.out / "checkpoints"
        self.ckpt_writer = CheckpointWriter(background=self.tcfg.async_checkpoint)
        self.park_buffers = HostBuffers()  # train.park_fold_nodes: pinned buffers kept from one update to the next
        self._maybe_resume()

    # ------------------------------------------------------------------ setup
    def _read_latest(self) -> dict[str, Any] | None:
        """The latest verified checkpoint (rank 0 reads it; torchrun moves it to every rank), or None."""
        folder = ckpt.latest_checkpoint(self.ckpt_root) if self.ckpt_root.exists() else None
        if folder is None:
            return None
        if not self.cfg.resume:
            raise ValueError(f"{self.out} already holds training checkpoints ({folder.name}); pass resume=true to continue "
                             "that run or choose another output_dir")
        return {"folder": str(folder), **ckpt.load_checkpoint(folder, "cpu" if self.session is not None else self.device)}

    def _maybe_resume(self) -> None:
        data = distributed.from_root("resume: read the latest checkpoint", self._read_latest)
        if data is None:
            return
        folder = Path(data["folder"])
        state = data["state"]
        missing = [k for k in ("epoch", "updates", "resume_key", "stat_tracker", "rng") if k not in state]
        if missing:
            raise ckpt.TrainCheckpointError(f"{folder / ckpt.STATE} lacks {missing}: not a complete training checkpoint")
        diff = resume_differences(_resume_key(self.cfg), state["resume_key"])
        if diff:
            raise ValueError(f"resume: the config differs from the checkpointed run in {diff[:8]}; "
                             "use the same settings or another output_dir")
        finished, wanted = int(state["epoch"]) + 1, self.tcfg.num_epochs
        if wanted < finished:
            raise ValueError(f"the run in {self.out} already finished {finished} epochs; train.num_epochs={wanted} is smaller: "
                             f"pass train.num_epochs>={finished} or another output_dir")
        own = {n: p for n, p in self.named}
        if set(own) != set(data["lora"]):
            raise ckpt.TrainCheckpointError(f"{folder}: LoRA tensors do not match the model's adapter")
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(data["lora"][n])
        self.optimizer.load_state_dict(data["optimizer"]["optimizer"])
        self.scheduler.load_state_dict(data["optimizer"]["scheduler"])
        if self.ema is not None:
            if data["ema"] is None:
                raise ckpt.TrainCheckpointError(f"{folder} has no EMA state but train.ema is on")
            self.ema.load_state_dict(data["ema"])
        self.tracker.load_state_dict(state["stat_tracker"])
        ckpt.set_rng_state(state["rng"])
        self.start_epoch = int(state["epoch"]) + 1
        self.updates = int(state["updates"])
        self.wandb_id = state.get("wandb_id")
        logger.info("train: resumed from %s (next epoch %d)", folder, self.start_epoch)
        if self.start_epoch == wanted:
            logger.info("train: all %d epochs are finished; nothing left to train", wanted)

    def _save(self, epoch: int) -> None:
        lora = {n: p.detach() for n, p in self.named}
        state = {
            "epoch": epoch, "updates": self.updates, "stat_tracker": self.tracker.state_dict(), "rng": ckpt.rng_state(),
            "data_position": {"next_epoch": epoch + 1, "prompts_consumed": (epoch + 1) * self.scfg.prompts_per_epoch},
            "noise": {"seed": self.seed, "next_sample_id": (epoch + 1) * self.scfg.prompts_per_epoch * self.scfg.num_image_per_prompt},
            "resume_key": _resume_key(self.cfg), "wandb_id": self.wandb_id,
        }
        opt = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        self._check_state(f"epoch {epoch}: checkpoint")
        with distributed.stage(f"epoch {epoch}: write the checkpoint"):
            if self.root:  # train.async_checkpoint: a host copy now, the files behind the next epoch
                self.ckpt_writer.save(self.ckpt_root, epoch, lora, opt, state, self.ema.state_dict() if self.ema else None)
                if self.ckpt_writer.last_wait_s > 1.0:
                    logger.info("train: waited %.1f s for the previous checkpoint's write", self.ckpt_writer.last_wait_s)

    def _check_state(self, when: str) -> None:
        """torchrun: every rank must hold the same LoRA, optimizer and EMA bytes (compared by hash)."""
        if self.session is not None:
            distributed.agree(f"training state at {when}",
                              {"lora, optimizer and EMA sha256": state_digest(self.named, self.optimizer, self.scheduler, self.ema)})

    # ------------------------------------------------------------------ phases
    def _rewards(self, final: torch.Tensor, prompt_ids: list[int], meta: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.rewards(final.detach(), self.grid, [self.prompt_texts[p] for p in prompt_ids], meta, self.images)

    def _pairs(self, samples: EpochSamples) -> list[tuple[int, int]]:
        return [(n, step) for n, sid in enumerate(samples.sample_ids)
                for step in train_steps_of(self.seed, sid, samples.sde_steps[n], self.tcfg.timestep_fraction)]

    def _eval_pairs(self, samples: EpochSamples, pairs: list[tuple[int, int]]):
        scale = self.scfg.guidance_scale if self.tcfg.cfg else 1.0
        return evaluate_pairs(self.model, samples, pairs, self.prompts, self.sigmas, self.grid, scale,
                              self.tcfg.cfg_layout, self.scfg.noise_level)

    def _check_old_logp(self, samples: EpochSamples, pairs: list[tuple[int, int]]) -> None:
        mb = self.tcfg.micro_batch
        with side(self.model, self.train_rt), torch.no_grad():
            for i in range(0, len(pairs), mb):
                chunk = pairs[i:i + mb]
                got = self._eval_pairs(samples, chunk).logp
                want = torch.stack([samples.logp[s, n] for n, s in chunk])
                bad = (got != want).nonzero().flatten().tolist()
                if bad:
                    n, s = chunk[bad[0]]
                    raise OldLogpMismatch(
                        f"train.recompute_old_logp: sample {samples.sample_ids[n]} step {s}: recomputed logp "
                        f"{float(got[bad[0]])!r} != rollout logp {float(want[bad[0]])!r} ({len(bad)} of {len(chunk)} pairs differ "
                        f"in this micro-batch; training runtime {self.train_rt.value}, rollout runtime {self.rollout_rt.value})")

    def _update_chunks(self, pairs: list[tuple[int, int]], epoch: int, inner: int) -> list[list[tuple[int, int]]]:
        """The pairs of inner epoch ``inner`` (shuffled with a key of seed, epoch and inner epoch) cut into updates."""
        order = list(pairs)
        if self.tcfg.shuffle:
            random.Random(f"pairs|{self.seed}|{epoch}|{inner}").shuffle(order)
        per_update = self.tcfg.micro_batch * self.tcfg.gradient_accumulation_steps
        return [order[u0:u0 + per_update] for u0 in range(0, len(order), per_update)]

    def _update_batches(self, samples: EpochSamples, chunk: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        """One update's pairs cut into micro-batches (by gradient key first with ``train.sort_update_pairs``)."""
        mb = self.tcfg.micro_batch
        if self.tcfg.sort_update_pairs:
            chunk = sorted(chunk, key=lambda p: pair_key(samples, p))
        return [chunk[m0:m0 + mb] for m0 in range(0, len(chunk), mb)]

    def _canonical_order(self, samples: EpochSamples, chunk: list[tuple[int, int]], scale: float) -> list[tuple[int, int]]:
        """The update's pairs in the order one process runs them (its statistics are concatenated in this order)."""
        batches = self._update_batches(samples, chunk)
        keys = [grad_keys(samples, b, scale) for b in batches]
        return [p for j in execution_order(keys) for p in batches[j]]

    def _rank_share(self, samples: EpochSamples, chunk: list[tuple[int, int]], scale: float) -> tuple[list[list[tuple[int, int]]], int]:
        """This rank's micro-batches of an update and the tree index of its first gradient key.

        One process: the update's micro-batches (``_update_batches``), first index 0. torchrun: the
        update's pairs sorted by gradient key, rank ``r``'s contiguous block of them, cut into micro-batches;
        a pair's keys are its CFG branches, so the block's keys start at ``block.start · branches``.
        """
        if self.session is None:
            return self._update_batches(samples, chunk), 0
        ordered = sorted(chunk, key=lambda p: pair_key(samples, p))
        span = layout.block(len(ordered), self.session.world_size, self.session.rank)
        return layout.cut(ordered[span.start:span.stop], self.tcfg.micro_batch), span.start * len(cfg_branches(scale))

    def _train(self, epoch: int, samples: EpochSamples, adv: torch.Tensor) -> dict[str, Any]:
        t = self.tcfg
        pairs = self._pairs(samples)
        if t.recompute_old_logp:
            self._check_old_logp(samples, pairs)
        per_update = t.micro_batch * t.gradient_accumulation_steps
        scale = self.scfg.guidance_scale if t.cfg else 1.0
        adv_dev = adv.to(device=self.device, dtype=torch.float32)
        norms, folds, canon = [], set(), []
        stats: dict[tuple[int, tuple[int, int]], torch.Tensor] = {}  # (update, pair) → its diagnostics (host)
        t_opt = t_comm = 0.0
        bytes_moved = 0
        sink_mb, sink_peak, sink_bound, sink_nodes, parked_mb, grouped, sink_s = 0.0, 0, 0, 0, 0.0, 0, 0.0
        n_updates = t.num_inner_epochs * math.ceil(len(pairs) / per_update)
        bar = tqdm(total=n_updates, desc=f"epoch {epoch} train [{self.train_rt.value}]", disable=not self.progress, leave=False)
        u_all = 0
        for inner in range(t.num_inner_epochs):
            for u, chunk in enumerate(self._update_chunks(pairs, epoch, inner)):
                weight = 1.0 / len(chunk)
                canon.append(self._canonical_order(samples, chunk, scale))
                batches, first = self._rank_share(samples, chunk, scale)
                keys = [grad_keys(samples, b, scale) for b in batches]
                run = execution_order(keys)
                flat = [k for ks in keys for k in ks]
                streamed = t.grad_sink == "streamed"
                # strict (fails closed: every LoRA product deposits): the backward skips autograd's sums, the fold replaces them
                sums = self.train_rt is not Runtime.STRICT
                park = (HostPark.for_micro_batches(keys, t.park_lookahead, self.park_buffers)
                        if streamed and t.park_fold_nodes else None)
                sink = (SampleGradSink(flat, first_index=first, autograd_sums=sums, park=park) if streamed
                        else SampleGradSink(autograd_sums=sums))
                sink_bound = max(sink_bound, pending_bound([keys[j] for j in run]) if streamed else len(flat))
                on_device: list[tuple[list[tuple[int, int]], torch.Tensor]] = []  # (micro-batch's pairs, their stat rows)
                with collect_sample_grads(sink), side(self.model, self.train_rt):
                    for j in run:
                        part = batches[j]
                        ev = self._eval_pairs(samples, part)
                        ref_mean = None
                        if t.beta > 0:
                            with torch.no_grad(), adapters_disabled(self.model):
                                ref_mean = self._eval_pairs(samples, part).mean
                        old = torch.stack([samples.logp[s, n] for n, s in part])
                        a = torch.stack([adv_dev[n] for n, _ in part])
                        pl = grpo_loss(ev.logp, old, a, weight, t.clip_range, t.adv_clip_max, t.beta, ev.mean, ref_mean, ev.std)
                        pl.loss.backward()
                        sink.done(keys[j])
                        d = ev.logp.detach() - old
                        differs = logp_bytes_differ(ev.logp, old)
                        # to the host once per update, not once per micro-batch (each copy waits for the GPU)
                        on_device.append((part, torch.stack([pl.ratio.double(), pl.clipped.double(), (0.5 * d ** 2).double(),
                                                             pl.policy.double(), pl.kl.double(), d.abs().double(),
                                                             differs.double()], dim=1)))
                rows = torch.cat([r for _, r in on_device]).cpu()
                for pair, row in zip((pair for part, _ in on_device for pair in part), rows):
                    stats[u_all, pair] = row
                t0 = time.perf_counter()
                traffic0 = distributed.traffic()
                before = traffic0.snapshot() if traffic0 is not None else None
                folds.add(self._fold_grads(sink, flat, first, f"epoch {epoch} update {u_all}"))
                st = sink.stats
                sink_mb = max(sink_mb, st.peak_pending_bytes / 2**20)
                sink_peak = max(sink_peak, st.peak_pending_per_param)
                sink_nodes = max(sink_nodes, st.peak_nodes_per_param)
                grouped = max(grouped, st.group_tensors)
                sink_s += st.host_seconds
                if park is not None:
                    parked_mb = max(parked_mb, park.stats.peak_host_bytes / 2**20)
                del sink
                norms.append(self._step())
                if traffic0 is not None and before is not None:
                    moved = traffic0.since(before)
                    t_comm += moved.seconds
                    bytes_moved += moved.bytes_out + moved.bytes_in
                    if self.dcfg.check_state == "update":
                        self._check_state(f"epoch {epoch} update {u_all}")
                t_opt += time.perf_counter() - t0
                u_all += 1
                bar.update(1)
                if self.on_update is not None:
                    self.on_update(epoch, inner, u)
        bar.close()
        if self.session is not None:  # every rank's pair diagnostics, so each can put them in one process's order
            for share in distributed.all_gather(f"epoch {epoch}: pair statistics", stats):
                stats.update(share)
        per_update_rows = [torch.stack([stats[u, p] for p in order]) for u, order in enumerate(canon)]
        allr = torch.cat(per_update_rows)
        r, fr = allr[:, 0], per_update_rows[0][:, 0]
        return {
            "pairs": len(pairs), "optimizer_updates": len(norms),
            "ratio_min": float(r.min()), "ratio_max": float(r.max()), "ratio_exact_one_frac": float((r == 1.0).double().mean()),
            "first_update_ratio_exact_one_frac": float((fr == 1.0).double().mean()),
            "first_update_ratio_max_abs_dev": float((fr - 1.0).abs().max()),
            "first_update_logp_max_abs_diff": float(per_update_rows[0][:, 5].max()),
            # the honest on-policy check: an FP32 ratio rounds to exactly 1.0 whenever |Δlogp| < ~6e-8
            "first_update_logp_bytes_differ": int(per_update_rows[0][:, 6].sum()),
            "first_update_pairs": int(fr.numel()),
            "clipfrac": float(allr[:, 1].mean()), "approx_kl": float(allr[:, 2].mean()),
            "policy_loss": float(allr[:, 3].mean()), "kl_loss": float(allr[:, 4].mean()),
            "grad_norm": float(sum(norms) / len(norms)), "grad_norm_last": float(norms[-1]),
            "lr": float(self.scheduler.get_last_lr()[0]), "grad_fold": "+".join(sorted(folds)),
            "grad_sink": t.grad_sink, "grad_sink_peak_buffer_mb": sink_mb,
            "grad_sink_peak_per_param": sink_peak, "grad_sink_bound_per_param": sink_bound,
            "grad_sink_peak_tree_nodes": sink_nodes, "grad_sink_parked_peak_mb": parked_mb,
            "grad_sink_group_tensors": grouped, "time_grad_sink_host_s": sink_s, "_time_optimizer": t_opt, "_time_comm": t_comm,
            "_bytes_moved": bytes_moved,
        }

    def _fold_grads(self, sink: SampleGradSink, keys: list, first: int, label: str) -> str:
        """Set each LoRA tensor's gradient to the grad sink's tree fold (across every rank under torchrun), in place of
        autograd's sum (which the strict backward skipped: ``SampleGradSink(autograd_sums=False)``)."""
        if self.session is not None:
            nodes = {n: range_nodes(sink, p, keys, first) for n, p in self.named}
            bare = [n for n, p in self.named if p.grad is not None and all(nd.value is None for nd in nodes[n])]
            if bare:
                raise RuntimeError(f"train: {bare[0]} got a gradient but no per-sample partials from the "
                                   f"{self.train_rt.value} backward, so it cannot be folded across ranks")
            merged = merge_update([n for n, _ in self.named], nodes, first, label)
            for n, p in self.named:
                g = merged[n]
                p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype)
            return "sink"
        folded = {}
        for n, p in self.named:
            f = sink.fold(p)
            if f is None and p.grad is None:
                continue  # no path to the loss (the last block's text stream)
            if f is None:
                if not sink.autograd_sums:
                    raise RuntimeError(f"train: {n} got autograd's gradient but no per-sample partials from the "
                                       f"{self.train_rt.value} backward, and the other tensors' sums were skipped")
                if self.train_rt is not Runtime.OFF and not self._warned_fold:
                    logger.warning("train: %s got no per-sample gradient partials from the %s backward; LoRA gradients are "
                                   "autograd's sums, which depend on the micro-batch split (grad_fold=autograd)", n, self.train_rt.value)
                    self._warned_fold = True
                return "autograd"
            folded[n] = f
        for n, p in self.named:
            if n in folded:
                p.grad = folded[n].to(p.dtype)
        return "sink"

    def _step(self) -> float:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            raise RuntimeError("no LoRA parameter received a gradient: check lora.targets and train.runtime")
        if self.tcfg.max_grad_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.tcfg.max_grad_norm, foreach=False))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update()
        self.updates += 1
        return norm

    def _evaluate(self) -> dict[str, float]:
        n = min(self.tcfg.eval_num_prompts, len(self.prompts.embeds))
        pids = list(range(n))
        if self.ema is not None:
            self.ema.swap()
        try:
            final = ode_sample(self.model, self.rollout_rt, self.prompts, pids, self.sigmas, self.grid, self.scfg, self.seed, EVAL_ID_BASE)
        finally:
            if self.ema is not None:
                self.ema.swap()
        total, _ = self._rewards(final, pids, [{"prompt_id": p, "eval": True} for p in pids])
        return {"eval_reward_mean": float(total.mean()), "eval_reward_std": float(total.std(unbiased=False))}

    # ------------------------------------------------------------------ the loop
    def run(self) -> TrainResult:
        """Train epochs ``start_epoch .. num_epochs - 1``; returns the metrics and the final LoRA.

        Under torchrun every rank trains; rank 0 alone writes the folder (config, metrics, wandb,
        checkpoints, plot, export), and the other ranks' result holds no metrics and no export.
        """
        E = self.tcfg.num_epochs
        mlog = None
        with distributed.stage("train: open the run folder"):
            if self.root:
                self.out.mkdir(parents=True, exist_ok=True)
                save_resolved(self.cfg, self.out)
                mlog = MetricLogger(self.out, self.cfg.wandb.mode, self.cfg.wandb.project, self.cfg.wandb.entity,
                                    OmegaConf.to_container(self.cfg, resolve=True), self.start_epoch, self.wandb_id)
                self.wandb_id = mlog.run_id
        bar = tqdm(range(self.start_epoch, E), desc="train", disable=not self.progress, initial=self.start_epoch, total=E)
        wandb_error = None
        try:
            for epoch in bar:
                row = self.train_epoch(epoch)
                if mlog is not None:
                    mlog.log(row)
                bar.set_postfix(reward=f"{row['reward_mean']:+.4f}", ratio1=f"{row['first_update_ratio_exact_one_frac']:.2f}")
                if (epoch + 1) % self.tcfg.save_freq == 0 or epoch + 1 == E:
                    self._save(epoch)
        except BaseException:
            try:  # the checkpoint in flight lands (or fails) before the error leaves
                self.ckpt_writer.wait()
            except Exception as exc:
                logger.error("train: %s", exc)
            raise
        finally:
            bar.close()
            if mlog is not None:
                rows = read_metrics(self.out)
                wandb_error = mlog.finish({"reward_mean_last": rows[-1]["reward_mean"]} if rows else None)
        lora = {n: p.detach().clone() for n, p in self.named}
        if not self.root:
            distributed.status("train: rank 0 wrote the plot and the export")
            return TrainResult(self.out, E, [], lora, {}, None)
        with distributed.stage("train: rank 0 wrote the plot and the export"):
            rows = read_metrics(self.out)
            if rows:
                names = " + ".join(f"{w:g}·{n}" for n, w in self.rewards.weights.items())
                plot_rewards(rows, self.out / "reward_curve.png",
                             f"Flow-GRPO LoRA, {self.mcfg.preset} model, reward {names}, seed {self.seed}")
                plot_epoch_costs(rows, self.out / "epoch_costs.png",
                                 f"Where each epoch's time goes ({self.mcfg.preset} model, {self.device})")
            exported = {}
            if self.tcfg.export:
                exported = export_lora(self.model, self.out / "lora", self.lcfg.rank, self.lcfg.alpha, self.lcfg.targets)
            self.ckpt_writer.wait()  # the last checkpoint, written while the plot and the export were
        return TrainResult(self.out, E, read_metrics(self.out), lora, exported, wandb_error)

    def _rollout(self, epoch: int) -> EpochSamples:
        """The epoch's rollout; under torchrun each rank (or model group, ``sample.parallel``) rolls out its block of
        sample positions and all gather the rest."""
        if self.session is None:
            return rollout_epoch(self.model, self.rollout_rt, self.prompts, self.sigmas, self.grid, self.scfg, self.seed, epoch)
        n = self.scfg.prompts_per_epoch * self.scfg.num_image_per_prompt
        lay = self.rollout_layout  # model groups (sample.parallel) split the positions as single ranks do
        span = layout.block(n, lay.groups(self.session.world_size), lay.coords(self.session.rank)["dp"])
        mine = list(span)
        with model_parallel(lay) as mp:
            samples = rollout_epoch(self.model, self.rollout_rt, self.prompts, self.sigmas, self.grid, self.scfg, self.seed,
                                    epoch, positions=mine)
        self.rollout_exchanges = int(mp.stats["calls"]) if mp is not None else 0
        own = mine if mp is None or mp.leader else []  # a model group's ranks hold the same rows: its first sends them
        shares = distributed.all_gather(f"epoch {epoch}: rollout rows",
                                        {"positions": own, "x": samples.x[:, own], "logp": samples.logp[:, own]})
        for r, share in enumerate(shares):
            if r != self.session.rank and share["positions"]:
                samples.x[:, share["positions"]] = share["x"].to(samples.x.device)
                samples.logp[:, share["positions"]] = share["logp"].to(samples.logp.device)
        return samples

    def _score(self, epoch: int, samples: EpochSamples) -> dict[str, Any]:
        """Rewards and advantages of the epoch (rank 0 computes them; torchrun moves them and the tracker to every rank)."""

        def score() -> dict[str, Any]:
            meta = [{"prompt_id": p, "sample_id": s, "epoch": epoch} for s, p in zip(samples.sample_ids, samples.prompt_ids)]
            total, parts = self._rewards(samples.final, samples.prompt_ids, meta)
            adv, adv_stats = self.tracker.advantages(total, samples.prompt_ids)
            return {"total": total, "parts": parts, "adv": adv, "adv_stats": adv_stats, "images": self.images.kind,
                    "tracker": self.tracker.state_dict() if self.session is not None else None}

        got = distributed.from_root(f"epoch {epoch}: rewards and advantages", score)
        if not self.root:
            self.tracker.load_state_dict(got["tracker"])
        return got

    def train_epoch(self, epoch: int) -> dict[str, Any]:
        """One epoch; returns its metrics row (the same on every rank under torchrun, times aside)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        traffic = distributed.traffic()
        before = traffic.snapshot() if traffic is not None else None
        t0 = time.perf_counter()
        if self.tcfg.release_training_graphs:
            release_training_graphs(self.model)
        samples = self._rollout(epoch)
        t1 = time.perf_counter()
        scored = self._score(epoch, samples)
        total, parts = scored["total"], scored["parts"]
        # The rollout's captured forwards are keyed by this epoch's prompt lengths, which later epochs rarely
        # draw again; their pools would sit beside the training steps' graphs and the grad sink's buffers
        # for the rest of the run (the evaluation's forwards are captured again at its next turn)
        release_forward_graphs(self.model)
        t2 = time.perf_counter()
        rollout_peaks = take_cuda_peaks(self.device)  # the rollout's and the scoring's, before the update's buffers
        train = self._train(epoch, samples, scored["adv"])
        t3 = time.perf_counter()
        train_peaks = take_cuda_peaks(self.device)
        row: dict[str, Any] = {"epoch": epoch, "updates_total": self.updates, "images": scored["images"],
                               "reward_mean": float(total.mean()), "reward_std": float(total.std(unbiased=False))}
        for name, s in parts.items():
            row[f"reward/{name}_mean"] = float(s.mean())
            row[f"reward/{name}_std"] = float(s.std(unbiased=False))
        row.update(scored["adv_stats"])
        t_opt = train.pop("_time_optimizer")
        t_fold_comm = train.pop("_time_comm")
        fold_bytes = train.pop("_bytes_moved")
        row.update(train)
        row.update({"time_rollout_s": t1 - t0, "time_reward_s": t2 - t1, "time_train_s": t3 - t2 - t_opt,
                    "time_optimizer_s": t_opt, "sde_window_starts": samples.window_starts,
                    "prompt_ids": sorted(set(samples.prompt_ids))})
        if rollout_peaks is not None and train_peaks is not None:  # CUDA; reserved also counts the graphs' pools
            for phase, (allocated, reserved) in (("rollout", rollout_peaks), ("train", train_peaks)):
                row[f"peak_memory_{phase}_mb"], row[f"peak_memory_reserved_{phase}_mb"] = allocated, reserved
            row["peak_memory_mb"] = max(rollout_peaks[0], train_peaks[0])
            row["peak_memory_reserved_mb"] = max(rollout_peaks[1], train_peaks[1])
        else:
            row["peak_memory_mb"] = peak_resident_set_mb()
        graphs = graph_stats(self.model)  # CUDA graphs so far (rollout forwards, training steps), where on
        if graphs is not None:
            row.update({f"cuda_graphs/{kind}_{k}": v for kind, s in graphs.items() for k, v in s.items()})
        if self.tcfg.eval_freq and (epoch + 1) % self.tcfg.eval_freq == 0:
            te = time.perf_counter()
            row.update(distributed.from_root(f"epoch {epoch}: evaluation", self._evaluate))
            row["time_eval_s"] = time.perf_counter() - te
        if traffic is not None and before is not None:
            moved = traffic.since(before)
            row.update({"world_size": self.session.world_size, "time_comm_s": moved.seconds,
                        "comm_bytes": moved.bytes_out + moved.bytes_in, "time_fold_comm_s": t_fold_comm,
                        "comm_bytes_per_update": fold_bytes / max(1, train["optimizer_updates"])})
            if not self.rollout_layout.trivial:  # the rollout's model-group exchanges (all epochs so far, this rank)
                row["rollout_exchanges"] = self.rollout_exchanges
        return row


def run_training(cfg: DictConfig, progress: bool = True, on_update: UpdateHook | None = None) -> TrainResult:
    """Train (or resume) the run configured by ``cfg`` in ``cfg.output_dir``.

    ``cfg`` is a composed ``train`` config (validated at compose time). The folder is claimed and locked
    like every run folder (a new or empty folder, or one an earlier run marked); ``train.cpu_threads``
    (when set) applies ``torch.set_num_threads`` to the whole process. Under torchrun rank 0 claims it.
    """
    if cfg.train.cpu_threads is not None:
        torch.set_num_threads(cfg.train.cpu_threads)
    from ..pipelines.chain import prepare_edit, prepare_prompts

    cfg, _ = prepare_prompts(cfg, kind="train")  # prompts.text → embeddings with the pipeline folder's text encoder (else a no-op)
    cfg = prepare_edit(cfg, kind="train")  # prompts.edit.source=folder → input pictures VAE-encoded to conditioning latents
    # a train folder (or a new one), locked against a second run
    with distributed.root_context("claim output_dir", lambda: claim_output_dir(cfg.output_dir, kind="train"), None):
        return Trainer(cfg, progress=progress, on_update=on_update).run()

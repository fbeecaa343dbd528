"""Typed sections of ``mmdit-strict train`` (Flow-GRPO with LoRA), mirrored by ``configs/train/*.yaml``.

Names follow Flow-GRPO's config where one exists (``sample.num_image_per_prompt``,
``train.timestep_fraction``, ``train.clip_range``, ``train.adv_clip_max``, ``train.beta``, ...), so its
users can carry a config over key by key. ``sample.num_steps``, ``sample.noise_level`` and
``sample.guidance_scale`` default to the ``sampler`` group's values (interpolations), so one place
sets the sampler for every command.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .parallel import ParallelConfig


@dataclass
class SampleConfig:
    """Rollout side of GRPO training: groups of images per prompt, SDE window."""

    num_steps: int = "${sampler.num_steps}"  # type: ignore[assignment]  # denoising steps per image
    noise_level: float = "${sampler.eta}"  # type: ignore[assignment]  # SDE eta
    guidance_scale: float = "${sampler.cfg_scale}"  # type: ignore[assignment]  # true-CFG scale (1.0 = no CFG)
    num_image_per_prompt: int = 4  # group size: images per prompt in one epoch
    prompts_per_epoch: int = 2  # prompts sampled per epoch (cycling through a keyed permutation of the prompt set)
    batch_size: int = 4  # samples per rollout forward (CFG doubles it in the batched layout)
    cfg_layout: str = "batched"  # batched | sequential
    same_latent: bool = False  # True: every image of a group starts from the same initial noise
    sde_window_size: int = 0  # 0: SDE on every step; k: SDE on k consecutive steps (window start keyed per group), ODE elsewhere
    sde_window_range: Optional[list] = None  # [lo, hi): window starts drawn from this step range (None: every legal start)
    runtime: Optional[str] = None  # None → runtime.mode
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # the rollout's model-parallel layout (torchrun)


@dataclass
class TrainConfig:
    """Training side of GRPO: optimisation, loss knobs, rewards, logging and checkpoints."""

    num_epochs: int = 10  # outer epochs: rollout → rewards → advantages → inner epochs
    num_inner_epochs: int = 1  # passes over one epoch's (sample, step) pairs
    timestep_fraction: float = 1.0  # fraction of each sample's SDE steps it trains on (a keyed random subset)
    micro_batch: int = 3  # (sample, step) pairs per forward/backward (Flow-GRPO's train.batch_size)
    gradient_accumulation_steps: int = 4  # micro-batches per optimizer update
    shuffle: bool = True  # shuffle the pairs (keyed by seed, epoch, inner epoch)
    cfg: bool = True  # CFG in training (same scale as the rollout); False trains the conditional branch alone
    cfg_layout: str = "sequential"  # batched | sequential
    grad_checkpointing: bool = True
    keep_attention_outputs: bool = True  # as recompute.keep_attention_outputs (checkpointed steps: memory for speed)
    # LoRA gradients are folded per (pair, branch) in sorted key order either way (same bytes):
    # streamed adds each partial as soon as every smaller key is in (memory: an accumulator per tensor plus
    # out-of-order partials); stored keeps one FP32 partial per tensor and key until the update
    grad_sink: str = "streamed"
    # True: each update's pairs (the shuffled set) are cut into micro-batches in gradient-key order, so the
    # streamed fold buffers at most one micro-batch's keys and a micro-batch mostly holds one prompt's samples
    # (few batch layouts, so the captured training steps are reused); same update sets, same gradient bytes.
    # False: micro-batches keep the shuffled composition, as Flow-GRPO cuts them
    sort_update_pairs: bool = True
    # True (streamed sink, CUDA): the fold's tree nodes that wait for a sibling subtree (up to log2 of the update's
    # keys, each an FP32 copy of the LoRA) sit in pinned host memory, copied back a micro-batch ahead of their join on a side
    # stream; same bytes, less device memory, PCIe traffic of about half a LoRA per key. The pinned buffers are kept
    # for the run (as many as the most nodes parked at once), since pinning them again each update is slow
    park_fold_nodes: bool = False
    # with park_fold_nodes: keys before a parked node's join at which its copy back starts, a covered node that joins
    # within them staying on the device. None: one micro-batch's keys (the copy overlaps that micro-batch's compute;
    # up to three nodes on the device). 0: every covered node parks and comes back at its join (one node on the device
    # at most; each join waits for its copy, about 1.6 GiB over PCIe for Qwen-Image's LoRA). Same bytes either way
    park_lookahead: Optional[int] = None
    # True (streamed sink, captured training steps on CUDA): a training forward whose sample keys are one node of the
    # fold's tree (in the batched CFG layout, a micro-batch of 2^k keys from a multiple of 2^k) folds its batch's
    # partials inside the captured backward: one partial buffer per LoRA tensor instead of one per tensor and sample,
    # nothing buffered out of order; same bytes (tests/model/test_train_graphs.py compares it with the uncaptured step
    # on the GPU). Nothing changes for a layout whose forwards are not such nodes (the sequential CFG layout)
    fold_captured_batches: bool = True
    # True (with fold_captured_batches, a streamed sink): a captured step whose micro-batch is a left child node of the
    # fold's tree leaves that node in the shared partial buffer, and the next step, its right sibling, adds its own node
    # into it inside its graph and hands the sink their parent: the left node is never copied out (an FP32 copy of the
    # LoRA, 1.6 GiB for Qwen-Image's rank 64). A node whose sibling does not come next is copied into the fold before
    # anything else writes the buffer. Same bytes (left + right, as the fold adds them)
    carry_fold_nodes: bool = False
    # True (CUDA graphs): each epoch drops the captured training steps, their memory pool and the shared partial
    # buffers before its rollout, so the rollout does not hold them beside its own captured forwards (about 7 + 1.6 GiB
    # at 1024², B = 2). A layout trained again is captured again; with prompt lengths that rarely repeat (as the
    # rollout's forwards, dropped after each rollout) that costs little. Same bytes either way
    release_training_graphs: bool = False
    runtime: Optional[str] = None  # None → runtime.mode; "off" shows how far the production path drifts
    recompute_old_logp: bool = False  # debug: recompute the old logp before training and require equal bytes
    clip_range: float = 1.0e-4
    adv_clip_max: float = 5.0
    beta: float = 0.0  # KL weight; the reference policy is the same model with the adapter disabled
    per_prompt_stat_tracking: bool = True  # advantages from per-prompt mean/std (else from the whole epoch)
    global_std: bool = False  # with per-prompt tracking: per-prompt mean, epoch-wide std
    learning_rate: float = 3.0e-4
    lr_warmup_steps: int = 0  # optimizer updates of linear warm-up, then constant
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_weight_decay: float = 1.0e-4
    adam_epsilon: float = 1.0e-8
    max_grad_norm: float = 1.0  # 0 disables clipping
    ema: bool = False  # keep an EMA of the LoRA weights (used for eval)
    ema_decay: float = 0.9
    # name or "module:function" → weight; set by the train group (train=tiny | flow_grpo): YAML layers merge
    # dicts, so only one layer names rewards. Weight 0 switches a reward off; +train.reward_fn.<name>=<w> adds one.
    reward_fn: dict = field(default_factory=dict)
    reward_kwargs: dict = field(default_factory=dict)  # name → keyword arguments of that reward
    eval_freq: int = 0  # every N epochs, ODE-sample the eval prompts and log their reward (0: never)
    eval_num_prompts: int = 2
    save_freq: int = 1  # checkpoint every N epochs (and always after the last)
    # write each checkpoint from a host copy in a background thread while training goes on (the same files; one
    # write in flight, waited for at the next checkpoint and at the end; the copy, a checkpoint's size of host memory,
    # is kept for the next one). false: write before the next epoch starts, no copy
    async_checkpoint: bool = True
    export: bool = True  # write the PEFT and diffusers LoRA folders after the last epoch
    cpu_threads: Optional[int] = None  # torch intra-op threads for this process (None: torch's default); the tiny run uses 1


TRAIN_CHOICES: dict[str, tuple[Any, ...]] = {
    "sample.cfg_layout": ("batched", "sequential"),
    "sample.runtime": (None, "strict", "audit", "auto", "off"),
    "train.cfg_layout": ("batched", "sequential"),
    "train.grad_sink": ("streamed", "stored"),
    "train.runtime": (None, "strict", "audit", "auto", "off"),
}

__all__ = ["SampleConfig", "TrainConfig", "TRAIN_CHOICES"]

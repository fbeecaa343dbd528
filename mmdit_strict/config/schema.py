"""Typed configuration of each command (the schemas every YAML in ``configs/`` is validated against).

Each command composes only the sections it reads (:data:`SCHEMAS`):

* ``run``, ``rollout``, ``sample``, ``recompute``: :class:`TrajectoryConfig` (model, runtime, sampler,
  prompts, rollout, recompute, lora, compare, wandb, distributed, seed, output_dir, resume, progress, extra);
* ``train``: :class:`TrainRunConfig` (model, runtime, sampler, prompts, lora, sample, train, wandb,
  seed, output_dir, resume, progress, extra);
* ``ablate``: :class:`AblateConfig` (the trajectory sections every job starts from, and ``ablation``:
  the entries; no wandb and no distributed section: the jobs log nothing and run in one process).

Unknown keys are errors: the composed config is merged onto these dataclasses with OmegaConf's
struct mode, so a typo, or a section another command reads, names itself and the valid keys beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

from omegaconf import OmegaConf

from .parallel import ParallelConfig
from .training import TRAIN_CHOICES, SampleConfig, TrainConfig


@dataclass
class ModelConfig:
    """Which transformer, on which device, in which execution dtype."""

    preset: str = "tiny"  # architecture preset: tiny | qwen-image
    checkpoint: Optional[str] = None  # diffusers folder or hub id; None → deterministic random init
    init_seed: int = 0  # seed of the random init when checkpoint is None
    dtype: str = "float32"  # float32 | bfloat16
    device: str = "cpu"  # cpu | cuda
    num_layers: Optional[int] = None  # override the preset's block count (for quick experiments)
    allow_large_cpu: bool = False  # permit preset=qwen-image on device=cpu (a 20 B-parameter model in host memory)
    cuda_graphs: bool = True  # replay no-grad strict/auto forwards on CUDA from graphs captured per batch layout


@dataclass
class RuntimeConfig:
    """Runtime mode of both sides unless a side overrides it."""

    mode: str = "strict"  # strict | audit | auto | off


@dataclass
class SamplerConfig:
    """Flow-GRPO sampling: sigma schedule, CFG and the SDE."""

    num_steps: int = 6
    height: int = 128  # pixels; latent grid = height / 16 tokens per side
    width: int = 128
    cfg_scale: float = 4.0
    eta: float = 0.7  # SDE noise level
    sde: bool = True  # False: deterministic Euler (ODE) steps, logp not defined


@dataclass
class EditConfig:
    """Edit conditioning (Qwen-Image-Edit, -Plus): one or several input images per sample, as packed VAE latents."""

    source: Optional[str] = None  # None: text-to-image | seeded: latents drawn per sample | latents: a file | folder: images
    sizes: list = field(default_factory=lambda: [[64, 64], [32, 96]])  # seeded: input (height, width) in pixels, cycled over samples
    seed: int = 0  # seeded: the draw's seed
    images_per_prompt: Any = 1  # seeded: input images per sample (Plus), a count or a list of counts cycled over samples
    latents: Optional[str] = None  # source=latents: safetensors of latents.{i} (h·w, C) and grid.{i} (2,), cycled over samples
    folder: Optional[str] = None  # source=folder: image files (sorted by name, cycled over samples), sides multiples of 16;
    #   or one subfolder per prompt (sorted by name) holding that prompt's images (sorted by name): several per prompt (Plus)
    vae_area: Optional[int] = None  # source=folder: resize each picture to about this many pixels (sides multiples of 32) before the VAE, as the Plus pipeline does (1048576); None: keep its size
    vae: Optional[str] = None  # source=folder: pipeline folder whose vae/ encodes them (None: model.checkpoint) | tiny


@dataclass
class PromptsConfig:
    """Pre-encoded prompts (Phase A starts from embeddings)."""

    num_prompts: int = 4
    embeddings: Optional[str] = None  # safetensors with prompt_embeds (N, L, C) and prompt_mask (N, L); None → synthetic
    text: Optional[list] = None  # prompt strings: `run` encodes them with model.checkpoint's text encoder (a pipeline folder)
    negative: str = " "  # negative prompt encoded with prompts.text
    min_tokens: int = 4  # synthetic prompts: valid lengths drawn in [min_tokens, max_tokens]
    max_tokens: int = 12
    negative_tokens: int = 3  # synthetic negative prompt length
    seed: int = 0
    edit: EditConfig = field(default_factory=EditConfig)  # input images (edit conditioning); source=None: none


@dataclass
class RolloutConfig:
    """The sampling engine side."""

    runtime: Optional[str] = None  # None → runtime.mode
    batch_size: int = 4  # prompts per forward
    cfg_layout: str = "batched"  # batched: cond and neg in one forward | sequential: two forwards
    pad_to: Optional[int] = None  # pad prompts to this many tokens (None → longest in the batch)
    save_tensors: bool = True  # store v_t, x_t, logp_t tensors (hashes are always stored)
    perturb: Optional[str] = None  # a named perturbation of this side (`mmdit-strict ablate --list`): a deliberate mismatch
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


@dataclass
class LoraConfig:
    """The policy's LoRA adapter: attached (unmerged) on both sides, as in GRPO the rollout samples the policy being trained."""

    rank: int = 4  # 0 → no LoRA
    alpha: float = 4.0
    targets: list = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                                                   "add_v_proj", "to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2"])
    init: str = "random"  # zero_b: B = 0 (PEFT default, policy unchanged) | random: both random (tests a live adapter)
    seed: int = 0


@dataclass
class RecomputeConfig:
    """The training side: re-evaluates every step from the recorded x_t with autograd on."""

    runtime: Optional[str] = None  # None → runtime.mode
    micro_batch: int = 3
    shuffle: bool = True  # shuffle sample order before splitting into micro-batches
    shuffle_seed: int = 1
    cfg_layout: str = "sequential"
    grad_checkpointing: bool = True
    # checkpointed strict steps keep each block's attention outputs for its recompute (same bytes, one attention
    # forward a block fewer, ~26 MB a block at 1024², B = 1 held until the backward); false: the least memory
    keep_attention_outputs: bool = True
    autograd: bool = True  # autograd on, and backward of -sum(logp) per micro-batch (LoRA grads)
    pad_to: Optional[int] = None
    # Deliberate mismatch to validate the localizer: "<operator key>@<step>", e.g. "block1.img.mlp_down_gemm@2"
    # bumps that operator's first output element by 2^-10·max(|x|,1) at that step (strict graph only).
    inject_fault: Optional[str] = None
    perturb: Optional[str] = None  # a named perturbation of this side (`mmdit-strict ablate --list`): a deliberate mismatch
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


@dataclass
class CompareConfig:
    localize: bool = True  # re-run the first drifting step with operator capture
    peer_loop: bool = False  # also time the same sampling with diffusers' transformer (eager, same weights)


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "mmdit-strict"
    entity: Optional[str] = None


@dataclass
class DistributedConfig:
    """Many processes under ``torchrun`` (docs/distributed.md); ignored by a single process.

    None of these enters a stage key: the bytes do not depend on the world size or the transport.
    """

    backend: str = "auto"  # auto: nccl for model.device=cuda, gloo on CPUs | gloo | nccl (gloo with cuda stages tensors through the host)
    timeout_s: float = 300.0  # bound on every collective: a dead or stuck rank ends the job (exit 2), never a hang
    # train: when the ranks compare hashes of the LoRA, optimizer state and EMA (a mismatch stops the job):
    # checkpoint (at every checkpoint) | update (after every optimizer update too: a debug mode)
    check_state: str = "checkpoint"


@dataclass
class TrajectoryConfig:
    """What ``run``, ``rollout``, ``sample`` and ``recompute`` read: both trajectory sides, compare and report."""

    seed: int = 0
    output_dir: str = "runs/default"
    resume: bool = True  # skip stages whose verified artifacts already exist
    progress: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # torchrun: backend, collective timeout
    extra: dict = field(default_factory=dict)  # free-form user keys (``+extra.foo=1``)


@dataclass
class TrainRunConfig:
    """What ``train`` reads: the model, the GRPO rollout side (``sample``) and optimisation side (``train``)."""

    seed: int = 0
    output_dir: str = "runs/default"
    resume: bool = True  # continue from the latest verified training checkpoint in output_dir
    progress: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)  # sample.* interpolate num_steps, eta, cfg_scale
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)  # GRPO rollout side
    train: TrainConfig = field(default_factory=TrainConfig)  # GRPO optimisation side
    wandb: WandbConfig = field(default_factory=WandbConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # torchrun: backend, timeout, state checks
    extra: dict = field(default_factory=dict)  # free-form user keys (``+extra.foo=1``)


@dataclass
class AblationConfig:
    """What ``ablate`` runs: one job per entry, each a ``run`` of the composed config plus the entry's changes.

    An entry is a mapping (``docs/ablation.md``):

    * ``name``: the job's folder under ``output_dir`` (letters, digits, ``_ . -``), unique;
    * ``kind``: ``probe`` (a deliberate mismatch the localizer must name), ``control`` (an invariance
      that must hold byte for byte) or ``combination`` (a rollout/recompute runtime pair);
    * ``perturb``: a registered perturbation (``mmdit-strict ablate --list``) applied to ``side``, or null;
    * ``side``: ``rollout`` | ``recompute`` (default ``recompute``), the side ``perturb`` acts on;
    * ``overrides``: ``key=value`` settings of the job (``recompute.micro_batch=1``);
    * ``expect``: a probe's operator key (default: its perturbation's ``caught_at``), ``identical`` for
      a control (the default), ``identical`` or ``drift`` for a combination.
    """

    entries: list = field(default_factory=list)  # the jobs, in order (mappings as above)
    probes: Optional[str] = None  # all: also one probe entry per registered perturbation no entry is named after
    only: Optional[list] = None  # run only the entries with these names (null: every entry)
    reward: str = "latent_stats"  # a `train` reward scored on the combinations' final latents (no VAE needed for latent_stats)


@dataclass
class AblateConfig:
    """What ``ablate`` reads: the trajectory sections each job starts from, and the ablation's entries."""

    seed: int = 0
    output_dir: str = "runs/ablation"  # jobs go to OUTPUT_DIR/<entry name>, the report to OUTPUT_DIR/ablation/
    resume: bool = True  # each job reuses its verified stages; the rollout is shared by jobs with equal rollout settings
    progress: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    ablation: AblationConfig = field(default_factory=AblationConfig)
    extra: dict = field(default_factory=dict)  # free-form user keys (``+extra.foo=1``)


#: The schema each command composes (the ``config`` command prints any of them with ``--for``).
SCHEMAS: dict[str, type] = {
    "run": TrajectoryConfig,
    "rollout": TrajectoryConfig,
    "sample": TrajectoryConfig,
    "recompute": TrajectoryConfig,
    "train": TrainRunConfig,
    "ablate": AblateConfig,
}


def schema_for(command: str) -> type:
    """The dataclass ``command`` composes; a ValueError naming the commands that compose one otherwise."""
    try:
        return SCHEMAS[command]
    except KeyError:
        raise ValueError(f"no config schema for command {command!r}; choose one of {sorted(SCHEMAS)}") from None


def section_names(schema: type) -> list[str]:
    """The top-level keys of ``schema``, in declaration order."""
    import dataclasses

    return [f.name for f in dataclasses.fields(schema)]


def commands_reading(key: str) -> list[str]:
    """The commands whose schema has the top-level key ``key``, in :data:`SCHEMAS` order."""
    return [c for c, s in SCHEMAS.items() if key in section_names(s)]


CHOICES: dict[str, tuple[Any, ...]] = {
    "model.dtype": ("float32", "bfloat16"),
    "model.preset": ("tiny", "qwen-image"),
    "runtime.mode": ("strict", "audit", "auto", "off"),
    "rollout.runtime": (None, "strict", "audit", "auto", "off"),
    "recompute.runtime": (None, "strict", "audit", "auto", "off"),
    "rollout.cfg_layout": ("batched", "sequential"),
    "recompute.cfg_layout": ("batched", "sequential"),
    "rollout.parallel.attention": ("ulysses", "allgather"),
    "recompute.parallel.attention": ("ulysses", "allgather"),
    "sample.parallel.attention": ("ulysses", "allgather"),
    "lora.init": ("zero_b", "random"),
    "wandb.mode": ("offline", "online", "disabled"),
    "distributed.backend": ("auto", "gloo", "nccl"),
    "distributed.check_state": ("checkpoint", "update"),
    "ablation.probes": (None, "all"),
    **TRAIN_CHOICES,
}


def choices_for(schema: type) -> dict[str, tuple[Any, ...]]:
    """The entries of :data:`CHOICES` whose section ``schema`` has."""
    names = set(section_names(schema))
    return {k: v for k, v in CHOICES.items() if k.split(".")[0] in names}


T = TypeVar("T")


def to_typed(node: Any, cls: type[T]) -> T:
    """``node`` (a composed section, typed or plain, or already a ``cls``) as a ``cls`` instance.

    Values are resolved and checked against ``cls``'s field types, so readers need no casts.
    """
    if isinstance(node, cls):
        return node
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), OmegaConf.to_container(node, resolve=True)))  # type: ignore[return-value]

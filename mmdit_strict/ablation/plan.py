"""The ablation plan: the ``ablation`` section's entries, checked and turned into jobs before any job runs.

An entry is one ``run`` of the composed config with the entry's changes (``docs/ablation.md``):

    kind         probe | control | combination
    perturb      a registered perturbation applied to ``side`` (``<side>.perturb=<name>``), or none
    overrides    key=value settings of the job, after the perturbation
    expect       probe: the operator key the localizer must name first (default: the perturbation's
                 ``caught_at``); control: ``identical``; combination: ``identical`` or ``drift``

``ablation.probes=all`` adds one probe per registered perturbation that no entry is named after, on
the recompute side, first. Every problem with the entries is found at compose time and reported at
once, naming the entry (:func:`plan_problems`); nothing has run then.

Operator keys name one call of the model graph (``block0.img.mlp_up_gemm_gelu``, ``img_in.latent_proj_gemm``)
or of the sampling chain (:data:`SAMPLING_KEYS`). A key the localizer reports for one part of a tuple
output (``block0.joint.joint_attention_fused.1``) matches the call's key without the index.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from ..config.arch import preset
from ..config.overrides import OverrideError, parse_override
from ..overlay import get_perturbation, known_perturbations

KINDS = ("probe", "control", "combination")
SIDES = ("rollout", "recompute")
IDENTICAL, DRIFT = "identical", "drift"
FIELDS = ("name", "kind", "perturb", "side", "overrides", "expect")
#: Names no entry may take: OUTPUT_DIR/ablation holds the report.
RESERVED = ("ablation",)
#: The sampling chain's operator keys (``trajectories.engine.sampling_op``): after the transformer, per step.
SAMPLING_KEYS = ("sampling.flow_sigma_table", "sampling.cfg_combine_renorm", "sampling.step_noise",
                 "sampling.flow_sde_step_logp")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_BLOCK = re.compile(r"^block(\d+)\.")
_PART = re.compile(r"\.\d+$")


class PlanError(ValueError):
    """The ablation's entries cannot run as written; the message names each entry and what is wrong."""


@dataclass(frozen=True)
class Entry:
    """One job of the ablation, checked."""

    name: str
    kind: str  # probe | control | combination
    expect: str  # an operator key (probe), identical (control), identical | drift (combination)
    perturb: str | None = None
    side: str = "recompute"
    overrides: tuple[str, ...] = ()

    def job_overrides(self) -> list[str]:
        """The job's ``key=value`` settings: the perturbation of its side, then the entry's overrides."""
        return [*([f"{self.side}.perturb={self.perturb}"] if self.perturb else []), *self.overrides]


def operator_key(key: str) -> str:
    """``key`` without a trailing tuple index (``…joint_attention_fused.1`` → ``…joint_attention_fused``)."""
    return _PART.sub("", key)


def key_problem(key: str, num_layers: int | None) -> str | None:
    """Why ``key`` is no operator key of the graph or the sampling chain (None when it is one)."""
    from ..trajectories.recompute import operator_keys

    key = operator_key(key)
    if key in SAMPLING_KEYS:
        return None
    m = _BLOCK.match(key)
    if _BLOCK.sub("block{}.", key) not in operator_keys():
        examples = ", ".join(["block0.img.mlp_up_gemm_gelu", "img_in.latent_proj_gemm", *SAMPLING_KEYS[:2]])
        return f"{key!r} is no operator key (keys look like {examples})"
    if m and num_layers is not None and int(m.group(1)) >= num_layers:
        return f"{key!r} names block {m.group(1)} but the model has {num_layers} blocks"
    return None


def _entry(raw: Any, i: int, num_layers: int | None) -> tuple[Entry | None, list[str]]:
    """One entry checked: (the entry, []) or (None, its problems)."""
    if not isinstance(raw, dict):
        return None, [f"ablation.entries[{i}] must be a mapping with {', '.join(FIELDS)}, got {raw!r}"]
    name = raw.get("name")
    label = f"ablation entry {name!r}" if name else f"ablation.entries[{i}]"
    out = []
    unknown = sorted(set(map(str, raw)) - set(FIELDS))
    if unknown:
        out.append(f"{label}: unknown field(s) {', '.join(unknown)} (an entry has {', '.join(FIELDS)})")
    if not isinstance(name, str) or not _NAME.match(name):
        out.append(f"{label}: name must be a folder name of letters, digits, '_', '.', '-', got {name!r}")
    elif name in RESERVED:
        out.append(f"{label}: the name {name!r} is reserved (OUTPUT_DIR/{name} holds the report)")
    kind = raw.get("kind")
    if kind not in KINDS:
        out.append(f"{label}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    side = raw.get("side") or "recompute"
    if side not in SIDES:
        out.append(f"{label}: side must be one of {', '.join(SIDES)}, got {side!r}")
    perturb = raw.get("perturb")
    caught_at = None
    if perturb is not None:
        if perturb not in known_perturbations():
            out.append(f"{label}: perturb={perturb!r} is no registered perturbation; choose one of {', '.join(known_perturbations())}")
        else:
            caught_at = get_perturbation(perturb).caught_at
    overrides = raw.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        out.append(f"{label}: overrides must be a list of key=value strings, got {overrides!r}")
        overrides = []
    for o in overrides:
        try:
            parse_override(o)
        except OverrideError as exc:
            out.append(f"{label}: {exc}")
    expect = raw.get("expect")
    if kind == "probe":
        expect = expect if expect is not None else caught_at
        if perturb is None and not overrides:
            out.append(f"{label}: a probe must change something: give perturb or overrides")
        if expect is None:
            out.append(f"{label}: a probe without a perturbation needs expect: the operator key where it must be caught")
        elif not isinstance(expect, str):
            out.append(f"{label}: expect must be an operator key, got {expect!r}")
        else:
            problem = key_problem(expect, num_layers)
            if problem:
                out.append(f"{label}: expect={problem}")
    elif kind == "control":
        expect = IDENTICAL if expect is None else expect
        if expect != IDENTICAL:
            out.append(f"{label}: a control expects {IDENTICAL!r}, got {expect!r}")
    elif kind == "combination":
        if expect not in (IDENTICAL, DRIFT):
            out.append(f"{label}: a combination needs expect: {IDENTICAL} or {DRIFT}, got {expect!r}")
    if out:
        return None, out
    return Entry(name=name, kind=kind, expect=str(expect), perturb=perturb, side=side, overrides=tuple(overrides)), []


def model_blocks(model: Any) -> int | None:
    """The block count a config builds, when it is known without loading a checkpoint."""
    if model.get("num_layers") is not None:
        return int(model.num_layers)
    if model.get("checkpoint") is not None:
        return None
    try:
        return preset(str(model.preset)).num_layers
    except ValueError:
        return None


def plan(cfg: DictConfig) -> list[Entry]:
    """The entries ``cfg`` (an ``ablate`` config) runs, in order; a :class:`PlanError` naming every problem."""
    section = cfg.ablation
    raw = OmegaConf.to_container(section.entries, resolve=True) if section.entries is not None else []
    if not isinstance(raw, list):
        raise PlanError(f"ablation.entries must be a list of entries, got {raw!r}")
    num_layers = model_blocks(cfg.model)
    problems: list[str] = []
    entries: list[Entry] = []
    for i, item in enumerate(raw):
        entry, found = _entry(item, i, num_layers)
        problems += found
        if entry is not None:
            entries.append(entry)
    named = {e.get("name") for e in raw if isinstance(e, dict)}
    if section.probes == "all":
        auto = [Entry(name=p, kind="probe", expect=get_perturbation(p).caught_at, perturb=p)
                for p in known_perturbations() if p not in named]
        entries = auto + entries
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            problems.append(f"ablation entry {e.name!r} is listed twice (names are folder names: make them unique)")
        seen.add(e.name)
    if section.only is not None:
        only = [str(n) for n in section.only]
        missing = [n for n in only if n not in seen]
        if missing:
            problems.append(f"ablation.only names no entry {', '.join(map(repr, missing))}; entries: {', '.join(e.name for e in entries)}")
        entries = [e for e in entries if e.name in only]
    if not entries and not problems:
        problems.append("ablation has no entries: pick experiment=ablation_tiny (CPU) or experiment=ablation_qwen_image "
                        "(GPU), or the group ablation=standard, or list ablation.entries")
    if problems:
        raise PlanError("; ".join(problems))
    return entries


def plan_problems(cfg: DictConfig) -> list[str]:
    """Compose-time check of an ``ablate`` config: every problem with its entries, one sentence each."""
    try:
        plan(cfg)
    except PlanError as exc:
        return [str(exc)]
    return []


def compose_ablate(overrides: Sequence[str] = (), config_dir: Any = None) -> DictConfig:
    """The config ``mmdit-strict ablate`` runs: the ``ablate`` schema composed from ``overrides``, its entries
    checked (the check needs the perturbation registry, so it lives here rather than in ``config``)."""
    from ..config.compose import compose

    return compose(overrides, config_dir=config_dir, command="ablate", checks=(plan_problems,))

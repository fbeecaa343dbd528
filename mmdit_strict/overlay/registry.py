"""The perturbation overlay: named semantic mismatches applied to one side of a run, by registry.

A :class:`Perturbation` stands for one way a rollout engine and a trainer can disagree about the
model or the sampler (GELU tanh vs exact, another text RoPE offset, a BF16 SDE step, ...). It holds
hooks keyed by operator name; while a side runs under :func:`perturbing`, every operator call of the
strict graph, the production forward and the sampling chain (``trajectories.engine.sampling_op``)
passes through :meth:`Overlay.call`, and the hook of that operator (if any) runs instead of the
plain call, given the call itself to wrap. Nothing else in the model knows the perturbations.

Zero cost when none is active: the operator paths read one field of the execution context
(``overlay``) and take the plain call when it is None. An active overlay counts as instrumentation:
no CUDA-graph replay and no fused kernels, so each hook sees its operator.

Each perturbation declares ``caught_at``, the operator key (``block0.img.mlp_up_gemm_gelu``,
``sampling.cfg_combine_renorm``) where the first-drift localizer must name it: the ablation checks
the localizer against that declaration.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from ..kernels.execution import bind, current

#: ``hook(overlay, where, call, args, kwargs) -> output``: ``call(*args, **kwargs)`` is the unperturbed operator.
Hook = Callable[["Overlay", str, Callable[..., Any], tuple, dict], Any]


@dataclass(frozen=True)
class Perturbation:
    """One named semantic mismatch (a factor of the RFC's ablation list)."""

    name: str
    factor: str  # the RFC factor it stands for: "GELU", "RoPE", "sigma schedule", ...
    description: str  # what changes, in one line
    caught_at: str  # the operator key where the localizer must see it first
    hooks: Mapping[str, Hook] = field(default_factory=dict)  # operator name → hook
    where: str | None = None  # only calls at this ``where`` (e.g. "block0.img"); None: every call of the operator
    strict_only: bool = False  # its hooks rewrite the strict graph's packed arguments (refused on a runtime=off side)


PERTURBATIONS: dict[str, Perturbation] = {}


def register_perturbation(p: Perturbation) -> Perturbation:
    """Add ``p`` to :data:`PERTURBATIONS` (names are unique)."""
    if p.name in PERTURBATIONS:
        raise ValueError(f"perturbation {p.name!r} is already registered")
    PERTURBATIONS[p.name] = p
    return p


def get_perturbation(name: str) -> Perturbation:
    """The registered perturbation ``name``; a ValueError listing the known ones otherwise."""
    _load_builtin()
    try:
        return PERTURBATIONS[name]
    except KeyError:
        raise ValueError(f"unknown perturbation {name!r}; registered: {', '.join(sorted(PERTURBATIONS))}") from None


def known_perturbations() -> list[str]:
    """The names of every registered perturbation, sorted."""
    _load_builtin()
    return sorted(PERTURBATIONS)


def _load_builtin() -> None:
    importlib.import_module(f"{__package__}.builtin")  # registers the built-in ones on first import


class Overlay:
    """An active perturbation bound to the model of the side it perturbs (hooks may read its weights)."""

    __slots__ = ("perturbation", "model", "hits")

    def __init__(self, perturbation: Perturbation, model: Any = None) -> None:
        self.perturbation = perturbation
        self.model = model
        self.hits = 0  # calls a hook replaced (a probe that never fires is reported as such)

    def call(self, name: str, where: str, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Operator ``name`` at ``where``: its hook when this perturbation has one there, else ``call``."""
        p = self.perturbation
        hook = p.hooks.get(name)
        if hook is None or (p.where is not None and where != p.where):
            return call(*args, **kwargs)
        self.hits += 1
        return hook(self, where, call, args, kwargs)


@contextlib.contextmanager
def perturbing(name: str | None, model: Any = None, runtime: str | None = None) -> Iterator[Overlay | None]:
    """Run the block with perturbation ``name`` applied (``None``: nothing changes, nothing is bound).

    ``model`` is the side's model (hooks that swap weights read it); ``runtime`` its runtime, checked
    against a strict-only perturbation.
    """
    if not name:
        yield None
        return
    p = get_perturbation(name)
    if p.strict_only and runtime == "off":
        raise ValueError(f"perturbation {name!r} rewrites the strict graph's arguments; it cannot run on a runtime=off side")
    overlay = Overlay(p, model)
    with bind(current().replace(overlay=overlay)):
        yield overlay


def perturb_fields(name: str | None, overlay: Overlay | None) -> dict[str, Any]:
    """A side's manifest fields for its perturbation: ``perturb`` (the name) and, when one ran,
    ``perturb_hits`` (operator calls its hooks replaced; 0 means it never fired on this side)."""
    if not name:
        return {"perturb": None}
    return {"perturb": name, "perturb_hits": overlay.hits if overlay is not None else 0}


def check_perturbations(sides: Mapping[str, tuple[str | None, str]]) -> None:
    """A clear error, before any work, for a side whose perturbation is unknown or cannot run in its runtime.

    ``sides``: side name (``rollout``, ``recompute``) → (its ``perturb`` setting, its resolved runtime).
    """
    problems = []
    for side, (name, runtime) in sides.items():
        if not name:
            continue
        if name not in known_perturbations():
            problems.append(f"{side}.perturb={name!r} is no registered perturbation; choose one of {', '.join(known_perturbations())}")
        elif get_perturbation(name).strict_only and runtime == "off":
            problems.append(f"{side}.perturb={name!r} rewrites the strict graph's arguments; {side} runs runtime=off")
    if problems:
        raise ValueError("; ".join(problems))

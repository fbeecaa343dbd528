"""The record sets of the survey: which sizes each section runs at, per profile.

* ``full`` — the H200 run (``benchmarks/h200/peers_evidence.sh``): Qwen-Image's widths; invariance at a handful of
  batch sizes and probe positions (up to B = 2048 for the per-sample modulation projection, up to 64 for the row
  operators, 8 for attention) and companion padding; accuracy at B ∈ {1, 64, 2048} for the per-sample projection,
  64 short samples and one 6889-token sequence for the row operators, 77 + 6889 tokens for attention (two heads:
  heads are independent, so the FP64 reference stays small); speed at B = 1 and a large batch.
* ``quick`` — the same on a GPU at a fraction of the sizes (a smoke run).
* ``tiny`` — the CPU (the test suite): tiny widths, FP32, a few rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .cases import QWEN_IMAGE, TINY, Case, Widths
from .harness import InvariancePlan

PROFILES = ("full", "quick", "tiny")


@dataclass(frozen=True)
class Plan:
    """What one case runs at in one profile: ``accuracy`` is a list of (rows per stream, batch size);
    ``speed`` maps ``small`` / ``large`` to (rows per stream, batch size)."""

    invariance: InvariancePlan
    accuracy: tuple[tuple[tuple[int, ...], int], ...]
    speed: dict[str, tuple[tuple[int, ...], int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Profile:
    """A record set: the widths, execution dtypes, the attention heads of its accuracy section, and a plan per case kind."""

    name: str
    widths: Widths
    dtypes: tuple[str, ...]
    accuracy_heads: int
    per_sample: Plan  # one row per sample (the modulation projection)
    rows: Plan  # image-token rows (projections, norms, QK-norm + RoPE)
    attention: Plan
    attention_fp32: Plan | None = None  # FP32 attention at smaller sequences (IEEE FP32 dots; SDPA math's memory)

    def plan(self, case: Case, dname: str) -> Plan:
        """The plan of ``case`` in dtype ``dname``."""
        if case.family == "attention":
            return self.attention_fp32 if dname == "fp32" and self.attention_fp32 else self.attention
        return self.per_sample if case.fixed_rows else self.rows


def _full() -> Profile:
    return Profile(
        "full", QWEN_IMAGE, ("bf16", "fp32"), 2,
        per_sample=Plan(InvariancePlan((1,), ((1, 1),), (2, 64, 2048), full_upto=64),
                        (((1,), 1), ((1,), 64), ((1,), 2048)), {"small": ((1,), 1), "large": ((1,), 2048)}),
        rows=Plan(InvariancePlan((4096,), ((1, 1024),), (2, 8, 64), (0, 7, 256)),
                  (((6889,), 1), ((32,), 64)), {"small": ((4096,), 1), "large": ((4096,), 8)}),
        attention=Plan(InvariancePlan((77, 6889), ((0, 256), (1024, 6889)), (2, 8), (0, 7, 179), pad_stream=0),
                       (((77, 6889), 1),), {"small": ((128, 4096), 1), "large": ((128, 4096), 8)}),
        attention_fp32=Plan(InvariancePlan((77, 1999), ((0, 256), (256, 1500)), (2, 3), (0, 7, 179), pad_stream=0),
                            (((77, 1999), 1),), {"small": ((128, 1024), 1), "large": ((128, 1024), 8)}),
    )


def _quick() -> Profile:
    return Profile(
        "quick", QWEN_IMAGE, ("bf16",), 2,
        per_sample=Plan(InvariancePlan((1,), ((1, 1),), (2, 64), full_upto=8), (((1,), 64),), {"small": ((1,), 1), "large": ((1,), 64)}),
        rows=Plan(InvariancePlan((1024,), ((1, 256),), (2, 8), (0, 7)), (((1024,), 1),), {"small": ((1024,), 1), "large": ((1024,), 4)}),
        attention=Plan(InvariancePlan((77, 1024), ((0, 128), (256, 1024)), (2,), (0, 7), pad_stream=0),
                       (((77, 1024), 1),), {"small": ((128, 1024), 1), "large": ((128, 1024), 4)}),
    )


def _tiny() -> Profile:
    return Profile(
        "tiny", TINY, ("fp32",), TINY.heads,
        per_sample=Plan(InvariancePlan((1,), ((1, 1),), (2, 5), full_upto=8), (((1,), 3),), {"small": ((1,), 1), "large": ((1,), 8)}),
        rows=Plan(InvariancePlan((9,), ((1, 6),), (2, 3), (0, 5)), (((11,), 1), ((3,), 2)), {"small": ((9,), 1), "large": ((9,), 3)}),
        attention=Plan(InvariancePlan((3, 9), ((0, 4), (1, 8)), (2, 3), (0, 5), pad_stream=0),
                       (((3, 9), 1),), {"small": ((3, 9), 1), "large": ((3, 9), 3)}),
    )


def profile(name: str) -> Profile:
    """The named profile (``full``, ``quick``, ``tiny``); an unknown name is an error."""
    makers = {"full": _full, "quick": _quick, "tiny": _tiny}
    if name not in makers:
        raise ValueError(f"unknown profile {name!r}; the profiles are {list(PROFILES)}")
    return makers[name]()


def accuracy_widths(p: Profile) -> Widths:
    """The widths the attention accuracy section draws at (fewer heads than the model: heads are independent)."""
    return replace(p.widths, heads=p.accuracy_heads)

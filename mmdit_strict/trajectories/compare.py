"""Compare two trajectories: first drifting (step, sample, quantity) and per-step drift curves."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .artifact import Trajectory, TrajectoryError
from .hashing import ulp_distance

QUANTITIES = ("v", "x", "logp")


@dataclass
class FirstDrift:
    step: int
    sample_id: int
    quantity: str  # v | x | logp
    sigma: float
    max_abs: float | None = None
    max_ulp: int | None = None
    block: int | None = None  # first block whose image-stream hash differs (audit-mode artifacts only)
    owners: str | None = None  # torchrun artifacts: the rank that computed the sample on each side


@dataclass
class Comparison:
    byte_identical: bool
    first: FirstDrift | None
    steps: int
    samples: int
    differing: dict[str, int]  # quantity → number of (step, sample) pairs whose hashes differ
    curves: dict[str, list[float]] = field(default_factory=dict)  # per step: v/x/logp max-abs, kl mean/max
    logp_ratio: dict[str, float] = field(default_factory=dict)  # exp(logp_b - logp_a) at step 0
    lora_grads_equal: bool | None = None  # both sides recomputed LoRA grads: sample-order folds equal at every step
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["first"] is not None and d["first"].get("owners") is None:
            del d["first"]["owners"]  # single-process artifacts: the report is as it always was
        return d


_SAME_INPUTS = ("sigma_sha256", "init_latents_sha256", "prompt_hashes", "sample_ids", "cfg_scale", "eta", "sde")


def check_comparable(a: Trajectory, b: Trajectory) -> list[str]:
    """Raise if the two sides did not replay the same inputs; return warnings for policy differences.

    Symmetric in ``a`` and ``b``; both manifests were validated on read, so equal step counts mean
    every per-step hash list lines up.
    """
    ma, mb = a.manifest, b.manifest
    if a.num_steps != b.num_steps or ma["grid"] != mb["grid"]:
        raise TrajectoryError(f"the trajectories differ in shape: {a.num_steps} vs {b.num_steps} steps, "
                              f"grid {ma['grid']} vs {mb['grid']}")
    for key in _SAME_INPUTS:
        if ma.get(key) != mb.get(key):
            raise TrajectoryError(f"the trajectories do not share their replay inputs: {key} differs")
    if ma["noise"]["keys"] != mb["noise"]["keys"]:
        raise TrajectoryError("the trajectories do not share their noise keys")
    warnings = []
    for key in ("fingerprint", "weights_sha256", "lora_sha256"):
        if ma.get(key) != mb.get(key):
            warnings.append(f"{key} differs between the sides: drift is expected")
    return warnings


def compare(a: Trajectory, b: Trajectory) -> Comparison:
    """Hash-compare every (step, sample) in order (v, then x, then logp); curves when both hold tensors."""
    warnings = check_comparable(a, b)
    S, ids = a.num_steps, a.sample_ids
    first: FirstDrift | None = None
    differing = {q: 0 for q in QUANTITIES}
    for s in range(S):
        for n, sid in enumerate(ids):
            for q in QUANTITIES:
                if a.step_hashes(s, q)[n] != b.step_hashes(s, q)[n]:
                    differing[q] += 1
                    if first is None:
                        first = FirstDrift(s, sid, q, a.manifest["steps"][s]["sigma"])
    if first is not None:
        first.block = _first_block(a, b, first.step, ids.index(first.sample_id))
        first.owners = owner_ranks(a, b, ids.index(first.sample_id))
    comp = Comparison(first is None, first, S, len(ids), differing, warnings=warnings)
    ga, gb = (t.manifest["side"].get("lora_grads_per_step") for t in (a, b))
    if ga and gb:
        comp.lora_grads_equal = all(
            x is not None and y is not None and x.get("sample_order_sha256") is not None
            and x.get("sample_order_sha256") == y.get("sample_order_sha256")
            for x, y in zip(ga, gb)
        )
    if a.has_tensors() and b.has_tensors():
        comp.curves = drift_curves(a, b)
        if first is not None:
            ta = _tensor(a, first.quantity, first.step)[ids.index(first.sample_id)]
            tb = _tensor(b, first.quantity, first.step)[ids.index(first.sample_id)]
            first.max_abs = float((ta.double() - tb.double()).abs().max())
            first.max_ulp = int(ulp_distance(ta, tb).max())
        if a.manifest["sde"]:
            r = torch.exp(b.tensors["logp"][0].double() - a.tensors["logp"][0].double())
            comp.logp_ratio = {"min": float(r.min()), "max": float(r.max()), "mean": float(r.mean())}
    return comp


def owner_ranks(a: Trajectory, b: Trajectory, n: int) -> str | None:
    """``"rollout rank 1, recompute rank 0"``: who computed sample position ``n`` on each side; None when
    neither side ran on many ranks (a single-process side reads "single process")."""
    ranks = [t.manifest["side"].get("owner_rank") for t in (a, b)]
    if not any(ranks):
        return None
    kinds = [str(t.manifest.get("kind")) for t in (a, b)]
    if kinds[0] == kinds[1]:
        kinds = [f"{kinds[0]} A", f"{kinds[1]} B"]
    return ", ".join(f"{k} rank {r[n]}" if r else f"{k} single process" for k, r in zip(kinds, ranks))


def _first_block(a: Trajectory, b: Trajectory, step: int, n: int) -> int | None:
    ha = a.manifest["steps"][step].get("blocks")
    hb = b.manifest["steps"][step].get("blocks")
    if not ha or not hb or ha[n] is None or hb[n] is None:
        return None
    for i, (x, y) in enumerate(zip(ha[n], hb[n])):
        if x != y:
            return i
    return None


def _tensor(t: Trajectory, q: str, step: int) -> torch.Tensor:
    return t.tensors["x"][step + 1] if q == "x" else t.tensors[q][step]


def drift_curves(a: Trajectory, b: Trajectory) -> dict[str, list[float]]:
    """Per step: max-abs drift of v, x, logp, and the KL between the two sides' Gaussian transitions.

    Both sides start a step from the same recorded x_t, so the transition means differ by
    ``Δv · c · dt`` with ``c = 1 + std²(1 − σ)/(2σ)``; with equal std the KL per sample is
    ``mean(Δmean²) / (2 (std √−dt)²)`` (FP64).
    """
    m = a.manifest
    out: dict[str, list[float]] = {f"{q}_max_abs": [] for q in QUANTITIES}
    out["kl_mean"], out["kl_max"] = [], []
    sig = [float(s) for s in m["sigma_table"]]
    smax = sig[1] if len(sig) > 1 else 0.0
    for s in range(a.num_steps):
        for q in QUANTITIES:
            out[f"{q}_max_abs"].append(float((_tensor(a, q, s).double() - _tensor(b, q, s).double()).abs().max()))
        if not m["sde"]:
            out["kl_mean"].append(0.0)
            out["kl_max"].append(0.0)
            continue
        sigma, sigma_prev, eta = sig[s], sig[s + 1], float(m["eta"])
        std = math.sqrt(sigma / (1 - (smax if sigma == 1 else sigma))) * eta
        dt = sigma_prev - sigma
        c = 1 + std * std * (1 - sigma) / (2 * sigma)
        dmean = (a.tensors["v"][s].double() - b.tensors["v"][s].double()) * c * dt
        var = (std * math.sqrt(-dt)) ** 2
        kl = (dmean * dmean).flatten(1).mean(1) / (2 * var)
        out["kl_mean"].append(float(kl.mean()))
        out["kl_max"].append(float(kl.max()))
    return out

"""One ablation row: what an entry's run observed, and whether that is what the entry expects.

Verdicts, from the job's comparison and localization (``trajectories.compare`` / ``localize``):

* a **probe** passes when the first drift the localizer names is its expected operator (keys compared
  without a tuple index); byte-identical sides fail as *not caught*, another operator fails as
  *caught at X, expected Y*, and drift the localizer cannot place in an operator fails too (the
  comparison's first drift is reported);
* a **control** passes when the sides are byte-identical in every ``v``, ``x`` and ``logp``;
* a **combination** passes when it is byte-identical (``expect: identical``) or not (``expect: drift``).

Every row also carries the logp figures of the GRPO ratio ``exp(logp_recompute − logp_rollout)``, read
from the two artifacts: max ``|Δlogp|`` and max ``|ratio − 1|`` in FP64 of the FP32 values, and how many
(step, sample) logp values differ in any byte — a ratio that rounds to 1.0 alone does not show equal bytes.
A combination row adds per-step curves, the KL between the two sides' transitions, the reward of
each side's final latents and where each side's time went.
"""

from __future__ import annotations

from typing import Any

import torch

from ..trajectories.artifact import Trajectory
from ..trajectories.pipeline import RunResult
from .plan import DRIFT, IDENTICAL, Entry, operator_key

#: Parts of the time split a run cannot measure here: one process (no exchange), embeddings given, no decode.
NOT_RUN = {"text_encoder": "not run (prompt embeddings are given)", "vae": "not run (no decode: latents are compared)"}


def first_drift(result: RunResult) -> dict[str, Any] | None:
    """The first drift of ``result``: its step, sample and quantity, and the operator the localizer named."""
    comp, loc = result.comparison, result.localization
    if comp.byte_identical or comp.first is None:
        return None
    f = comp.first
    out: dict[str, Any] = {"step": f.step, "sample_id": f.sample_id, "quantity": f.quantity, "sigma": f.sigma,
                           "max_abs": f.max_abs, "max_ulp": f.max_ulp, "key": None, "operator": None, "block": f.block,
                           "stream": None, "branch": None, "row": None, "element": None}
    if loc is not None and loc.first is not None:
        o = loc.first
        out.update(key=o.key, operator=o.operator, block=o.block, stream=o.stream, branch=o.branch, row=o.logical_row,
                   element=o.element, operator_max_abs=o.max_abs, operator_max_ulp=o.max_ulp)
    if loc is not None and loc.notes:
        out["notes"] = list(loc.notes)
    return out


def logp_figures(rollout: Trajectory, recompute: Trajectory) -> dict[str, Any]:
    """Max |Δlogp|, max |ratio − 1| (overall and per step) and the count of logp values differing in any byte."""
    from ..training.loss import logp_bytes_differ

    a, b = rollout.tensors["logp"], recompute.tensors["logp"]  # (S, N) FP32
    d = b.double() - a.double()
    dev = (torch.exp(d) - 1.0).abs()
    return {
        "max_abs_dlogp": float(d.abs().max()),
        "max_ratio_dev": float(dev.max()),
        "ratio_dev_per_step": [float(v) for v in dev.max(dim=1).values],
        "logp_bytes_differ": int(logp_bytes_differ(b.reshape(-1), a.reshape(-1)).sum()),
        "logp_values": int(a.numel()),
    }


def rewards(rollout: Trajectory, recompute: Trajectory, reward: str) -> dict[str, Any]:
    """``reward`` (a `train` reward) of each side's final latents: the recompute's last step starts from the
    rollout's recorded latents, so the two differ only by that step's drift."""
    from ..training.rewards import RewardSet

    grid = tuple(rollout.manifest["grid"])
    ids = rollout.sample_ids
    prompts, meta = [f"prompt {i}" for i in ids], [{"sample_id": i} for i in ids]
    scores = RewardSet({reward: 1.0})
    ra, _ = scores(rollout.tensors["x"][-1], grid, prompts, meta)  # type: ignore[arg-type]
    rb, _ = scores(recompute.tensors["x"][-1], grid, prompts, meta)  # type: ignore[arg-type]
    return {"name": reward, "rollout_mean": float(ra.mean()), "recompute_mean": float(rb.mean()),
            "max_abs_diff": float((ra - rb).abs().max())}


def time_split(t: Trajectory) -> dict[str, Any]:
    """Seconds of a side in model, CFG and scheduler (as the side recorded them), communication (one process:
    0) and the parts that did not run; ``recorded: False`` when the artifact holds no split."""
    split = t.manifest["side"].get("time_split")
    out: dict[str, Any] = {"wall": t.manifest.get("wall_seconds")}
    if split is None:
        out["recorded"] = False
    else:
        out.update({k: float(v) for k, v in split.items()})
    out["communication"] = 0.0
    out.update(NOT_RUN)
    return out


def _perturb_hits(entry: Entry, rollout: Trajectory, recompute: Trajectory) -> int | None:
    side = (rollout if entry.side == "rollout" else recompute).manifest["side"]
    return side.get("perturb_hits")


def _where(d: dict[str, Any]) -> str:
    if d.get("key"):
        return f"{d['key']} (step {d['step']}, row {d['row']})"
    return f"step {d['step']}, sample {d['sample_id']}, {d['quantity']}"


def _fields(entry: Entry) -> dict[str, Any]:
    return {"name": entry.name, "kind": entry.kind, "expected": entry.expect, "perturb": entry.perturb, "side": entry.side,
            "overrides": list(entry.overrides)}


def verdict(entry: Entry, drift: dict[str, Any] | None, hits: int | None) -> tuple[bool, str]:
    """(passed, one line saying why) for ``entry`` given its first ``drift`` (None: byte-identical)."""
    if entry.kind == "probe":
        if drift is None:
            why = "not caught: v, x and logp are byte-identical on both sides"
            if hits == 0:
                why += f" (its hooks never fired on the {entry.side} side)"
            return False, why
        if drift.get("key") is None:
            return False, (f"drift in {drift['quantity']} at step {drift['step']}, sample {drift['sample_id']}, but the localizer "
                           f"named no operator; expected {entry.expect}")
        if operator_key(drift["key"]) != operator_key(entry.expect):
            return False, f"caught at {drift['key']}, expected {entry.expect}"
        return True, f"caught at {drift['key']}"
    if entry.expect == IDENTICAL:
        return (True, "byte-identical") if drift is None else (False, f"drifted: first at {_where(drift)}")
    if entry.expect == DRIFT:
        return (False, "expected drift, but the sides are byte-identical") if drift is None else (True, f"drifts: first at {_where(drift)}")
    raise ValueError(f"entry {entry.name!r}: unknown expectation {entry.expect!r}")


def judge(entry: Entry, result: RunResult, rollout: Trajectory, recompute: Trajectory, reward: str) -> dict[str, Any]:
    """The row of ``entry``: its verdict, first drift, logp figures (and a combination's curves, KL, reward, time)."""
    drift = first_drift(result)
    hits = _perturb_hits(entry, rollout, recompute)
    passed, why = verdict(entry, drift, hits)
    row: dict[str, Any] = {**_fields(entry), "status": "passed" if passed else "failed", "passed": passed, "reason": why,
                           "first_drift": drift, "differing": dict(result.comparison.differing),
                           "perturb_hits": hits, "runtimes": [rollout.manifest["runtime"], recompute.manifest["runtime"]],
                           "output_dir": str(result.out_dir)}
    if rollout.has_tensors() and recompute.has_tensors():
        row.update(logp_figures(rollout, recompute))
    if entry.kind == "combination":
        curves = result.comparison.curves
        row["curves"] = {k: list(v) for k, v in curves.items()}
        row["kl_max"] = max(curves["kl_max"]) if curves.get("kl_max") else None
        row["reward"] = rewards(rollout, recompute, reward) if rollout.has_tensors() else None
        row["time_split"] = {"rollout": time_split(rollout), "recompute": time_split(recompute)}
        row["recompute_side"] = {k: recompute.manifest["side"].get(k)
                                 for k in ("micro_batch", "shuffle", "cfg_layout", "autograd", "grad_checkpointing")}
    return row


def error_row(entry: Entry, exc: BaseException, output_dir: str) -> dict[str, Any]:
    """The row of an entry whose job failed with ``exc`` (neither passed nor failed: an error)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return {**_fields(entry), "status": "error", "passed": False, "reason": f"error: {type(exc).__name__}: {text}",
            "first_drift": None, "output_dir": output_dir}

"""The main job: rollout → recompute → compare → (localize) → report, resumable per stage.

Before any step runs, the output folder is claimed (see :mod:`.outdir`) and everything that can be
checked is: the rollout side's model is built and hashed, the prompts are made, both sides'
``pad_to`` and the planted fault are checked against them. A stage's verified artifact is reused
only when its stage key (settings, weights, LoRA, prompts, version; see :mod:`.stagekey`) equals
the current one; otherwise the stage re-runs and the log says which part changed.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from .. import distributed
from ..environment import run_environment
from ..overlay import check_perturbations
from ..config.compose import save_resolved
from . import artifact
from .compare import Comparison, compare
from .localize import Localization, localize
from .outdir import claim_output_dir
from .peer import peer_rollout
from .recompute import check_fault, run_recompute
from .record import model_hashes
from .report import summary_line, write_report
from .rollout import run_rollout, warm_up
from .setup import build_side_model, check_pad_to, make_prompts, side_runtime
from .stagekey import describe_mismatch, recompute_key, rollout_key

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    comparison: Comparison
    localization: Localization | None
    report: dict[str, Any]
    out_dir: Path

    @property
    def byte_identical(self) -> bool:
        return self.comparison.byte_identical

    @property
    def summary(self) -> str:
        return summary_line(self.comparison, self.localization)


def _reusable(path: Path, resume: bool, key: dict[str, Any], stage: str) -> artifact.Trajectory | None:
    """The verified artifact at ``path`` when it was made under ``key``; None (saying why) otherwise."""
    if not resume or not (path / artifact.MANIFEST).exists():
        return None
    try:
        done = artifact.read(path)
    except artifact.TrajectoryError as exc:
        logger.warning("re-running %s: %s", stage, exc)
        return None
    stored = done.manifest.get("stage_key")
    if stored != key:
        logger.warning("re-running %s: %s", stage, describe_mismatch(stored, key))
        return None
    logger.info("%s: reusing verified artifact %s", stage, path)
    return done


def rollout_stage(cfg: DictConfig, out: Path, progress: bool,
                  phases: dict[str, float] | None = None) -> tuple[artifact.Trajectory, dict[str, str | None], dict[str, Any] | None]:
    """Checks before any work, then the rollout (reused when its key matches) and, with
    ``compare.peer_loop``, the peer's timing of the same sampling; returns (rollout, model hashes, peer)."""
    phases = phases if phases is not None else {}
    check_perturbations({side: (cfg[side].perturb, side_runtime(cfg, side).value) for side in ("rollout", "recompute")})
    t0 = time.perf_counter()
    model = build_side_model(cfg.model, cfg.lora, side_runtime(cfg, "rollout"))
    phases["build"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    hashes = model_hashes(model)
    phases["hash_weights"] = time.perf_counter() - t0
    distributed.agree("rollout model", hashes)  # torchrun: every rank built the same model
    prompts = make_prompts(cfg.prompts, model.config, cfg.model.device, cfg.model.dtype)
    for side in ("rollout", "recompute"):
        check_pad_to(side, cfg[side].pad_to, prompts, float(cfg.sampler.cfg_scale))
    check_fault(cfg.recompute.inject_fault, model.config.num_layers, int(cfg.sampler.num_steps))
    t0 = time.perf_counter()
    key = rollout_key(cfg, hashes, prompts.hashes())
    done = distributed.from_root("rollout: reuse check", lambda: _reusable(out / "rollout", bool(cfg.resume), key, "rollout"))
    if done is None:
        phases["compile"] = warm_up(cfg, model, prompts)
        t0 = time.perf_counter()
        done = run_rollout(cfg, out / "rollout", progress=progress, model=model, hashes=hashes)
    phases["rollout"] = time.perf_counter() - t0
    peer = None
    if cfg.compare.peer_loop:
        t0 = time.perf_counter()
        peer = peer_rollout(cfg, model, prompts, progress=progress)
        phases["peer_rollout"] = time.perf_counter() - t0
    return done, hashes, peer


def recompute_stage(cfg: DictConfig, rollout: artifact.Trajectory, out: Path, progress: bool,
                    hashes: dict[str, str | None]) -> artifact.Trajectory:
    """The recompute (reused when its key, which names the rollout file it replays, matches)."""
    key = recompute_key(cfg, hashes, rollout)
    done = distributed.from_root("recompute: reuse check", lambda: _reusable(out / "recompute", bool(cfg.resume), key, "recompute"))
    if done is not None:
        return done
    return run_recompute(cfg, rollout, out / "recompute", progress=progress)


def compare_stage(cfg: DictConfig, rollout: artifact.Trajectory, recompute: artifact.Trajectory, out: Path,
                  phases: dict[str, float] | None = None, peer: dict[str, Any] | None = None) -> RunResult:
    artifact.require_kind(rollout, "rollout")
    artifact.require_kind(recompute, "recompute")
    t0 = time.perf_counter()
    comp = compare(rollout, recompute)
    loc = None
    if not comp.byte_identical and cfg.compare.localize and comp.first is not None:
        loc = localize(rollout, recompute, comp.first)
    if phases is not None:
        phases["compare"] = time.perf_counter() - t0
    report = write_report(out / "report", rollout, recompute, comp, loc, phases=phases, peer=peer,
                          environment=run_environment(str(cfg.model.device)))
    return RunResult(comp, loc, report, out)


def run_all(cfg: DictConfig, progress: bool = True) -> RunResult:
    """Run the whole job in ``cfg.output_dir`` (claimed and locked while it runs); matching stages are reused."""
    phases: dict[str, float] = {}
    # torchrun: rank 0 alone claims the folder and writes the config, artifacts and report
    with distributed.root_context("claim output_dir", lambda: claim_output_dir(cfg.output_dir), Path(cfg.output_dir)) as out:
        if distributed.is_root():
            save_resolved(cfg, out)
        rollout, hashes, peer = rollout_stage(cfg, out, progress, phases)
        gc.collect()  # the rollout model (graphs, prepacked weights) may sit in reference cycles: free it first
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        recompute = recompute_stage(cfg, rollout, out, progress, hashes)
        phases["recompute"] = time.perf_counter() - t0
        return distributed.from_root("compare and report", lambda: compare_stage(cfg, rollout, recompute, out, phases, peer))

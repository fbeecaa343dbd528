"""The main job: rollout → recompute → compare → (localize) → report, resumable per stage."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..config.compose import save_resolved
from . import artifact
from .compare import Comparison, compare
from .localize import Localization, localize
from .recompute import run_recompute
from .report import summary_line, write_report
from .rollout import run_rollout

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


def _load_if_done(path: Path, resume: bool) -> artifact.Trajectory | None:
    if not resume or not (path / artifact.MANIFEST).exists():
        return None
    try:
        return artifact.read(path)
    except artifact.TrajectoryError as exc:
        logger.warning("re-running %s: %s", path.name, exc)
        return None


_NOT_ROLLOUT = ("recompute", "compare", "output_dir", "resume", "progress", "wandb", "_choices_")
_NOT_RECOMPUTE = ("compare", "output_dir", "resume", "progress", "wandb", "_choices_")


def _same_config(traj: artifact.Trajectory, cfg: DictConfig, ignore: tuple[str, ...]) -> bool:
    """Whether a stored artifact was made with the same settings that matter to its stage."""
    new = OmegaConf.to_container(cfg, resolve=True)
    old = traj.manifest["config"]
    return {k: v for k, v in old.items() if k not in ignore} == {k: v for k, v in new.items() if k not in ignore}


def rollout_stage(cfg: DictConfig, out: Path, progress: bool) -> artifact.Trajectory:
    done = _load_if_done(out / "rollout", bool(cfg.resume))
    if done is not None and _same_config(done, cfg, _NOT_ROLLOUT):
        logger.info("rollout: reusing verified artifact %s", out / "rollout")
        return done
    return run_rollout(cfg, out / "rollout", progress=progress)


def recompute_stage(cfg: DictConfig, rollout: artifact.Trajectory, out: Path, progress: bool) -> artifact.Trajectory:
    done = _load_if_done(out / "recompute", bool(cfg.resume))
    if done is not None and _same_config(done, cfg, _NOT_RECOMPUTE) and done.manifest["init_latents_sha256"] == rollout.manifest["init_latents_sha256"]:
        logger.info("recompute: reusing verified artifact %s", out / "recompute")
        return done
    return run_recompute(cfg, rollout, out / "recompute", progress=progress)


def compare_stage(cfg: DictConfig, rollout: artifact.Trajectory, recompute: artifact.Trajectory, out: Path) -> RunResult:
    comp = compare(rollout, recompute)
    loc = None
    if not comp.byte_identical and cfg.compare.localize and comp.first is not None and comp.first.quantity == "v":
        loc = localize(cfg, rollout, recompute, comp.first)
    report = write_report(out / "report", rollout, recompute, comp, loc)
    return RunResult(comp, loc, report, out)


def run_all(cfg: DictConfig, progress: bool = True) -> RunResult:
    """Run the whole job in ``cfg.output_dir``; stages with verified artifacts of the same config are reused."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_resolved(cfg, out)
    rollout = rollout_stage(cfg, out, progress)
    recompute = recompute_stage(cfg, rollout, out, progress)
    return compare_stage(cfg, rollout, recompute, out)

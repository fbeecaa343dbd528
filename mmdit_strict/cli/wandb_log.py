"""wandb logging of a run's comparison (offline by default: no network needed)."""

from __future__ import annotations

import logging
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

logger = logging.getLogger(__name__)


def require_wandb(mode: str) -> None:
    """Fail before any work when ``mode`` logs to wandb and the package is missing (not after the run)."""
    if mode == "disabled":
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ValueError(f"wandb.mode={mode} needs the wandb package: pip install wandb, "
                         "or pass wandb.mode=disabled") from None


def log_run(cfg: DictConfig, result: Any) -> None:
    """Log drift curves and the summary to wandb in ``cfg.wandb.mode`` (offline | online | disabled)."""
    if cfg.wandb.mode == "disabled":
        return
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(
        project=cfg.wandb.project, entity=cfg.wandb.entity, mode=cfg.wandb.mode, dir=str(cfg.output_dir),
        config=OmegaConf.to_container(cfg, resolve=True), job_type="consistency", reinit="finish_previous",
    )
    curves = result.comparison.curves
    for s in range(result.comparison.steps):
        run.log({k: v[s] for k, v in curves.items()} | {"step": s}) if curves else None
    run.summary["byte_identical"] = result.byte_identical
    run.summary["summary"] = result.summary
    run.finish()

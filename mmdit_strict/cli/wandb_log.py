"""wandb logging of a run's comparison (offline by default: no network needed)."""

from __future__ import annotations

import logging
import netrc
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from omegaconf import DictConfig, OmegaConf

logger = logging.getLogger(__name__)


def wandb_key_configured() -> bool:
    """Whether a wandb credential is configured where ``wandb login`` and wandb's environment put one:
    ``WANDB_API_KEY``, ``WANDB_IDENTITY_TOKEN_FILE``, or a netrc entry (``$NETRC`` or ``~/.netrc``)
    for the host of ``WANDB_BASE_URL`` (default ``api.wandb.ai``). Looked up, not verified."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        return netrc.netrc(str(path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def require_wandb(mode: str) -> None:
    """Fail before any work (not after the run) when ``mode`` logs to wandb and the package is missing,
    or, for ``online``, when no credential is configured and there is no terminal to ask for one on.

    The credential is looked up, not verified against the server: that needs the network, and
    ``wandb.init`` reports a rejected key itself.
    """
    if mode == "disabled":
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ValueError(f"wandb.mode={mode} needs the wandb package: pip install wandb, "
                         "or pass wandb.mode=disabled") from None
    if mode == "online" and not wandb_key_configured() and not sys.stdin.isatty():
        raise ValueError("wandb.mode=online needs a wandb login and none is configured: run `wandb login`, "
                         "set WANDB_API_KEY, or pass wandb.mode=offline")


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

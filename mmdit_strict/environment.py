"""Where a run or a benchmark executed: commit, GPU or CPU, driver and library versions (for every report)."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch


def _git(args: list[str], cwd: Path) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None


def commit() -> str:
    """The measured commit: ``MMDIT_COMMIT`` when set (device machines may carry a stale ``.git``), else the
    HEAD of the git repository that tracks this package's own sources; "unknown" otherwise.

    git asked from the package's folder also answers for an enclosing repository that does not track
    the package (an unpacked copy inside another project): such a HEAD is not the code that ran, so
    the package's ``__init__.py`` must be tracked there.
    """
    env = os.environ.get("MMDIT_COMMIT")
    if env:
        return env
    package = Path(__file__).resolve().parent
    tracked = _git(["ls-files", "--error-unmatch", "--", "__init__.py"], package)
    if tracked is None or tracked.returncode != 0:
        return "unknown (the package is not tracked by git here, MMDIT_COMMIT unset)"
    head = _git(["rev-parse", "HEAD"], package)
    out = head.stdout.strip() if head is not None and head.returncode == 0 else ""
    return out or "unknown (no git, MMDIT_COMMIT unset)"


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def gpu_environment() -> dict[str, Any]:
    """GPU name, driver, torch / Triton / CUDA versions, TF32 switches, commit and UTC date (CUDA must be present)."""
    import triton

    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        driver = None
    return {
        "gpu": torch.cuda.get_device_name(0), "driver": driver, "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda, "commit": commit(),
        "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32},
        "date_utc": _utc_now(),
    }


def run_environment(device: str) -> dict[str, Any]:
    """Where a run executed: :func:`gpu_environment` on a CUDA device, else the CPU, torch, commit and date."""
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return gpu_environment()
    return {"gpu": None, "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "commit": commit(), "date_utc": _utc_now()}


def environment_line(env: dict[str, Any], *extra: str) -> str:
    """The one-line header every report prints: GPU, driver, versions, commit, date, then ``extra`` items."""
    if not env.get("gpu") and env.get("cpu"):
        where = [f"CPU {env['cpu']}", f"torch {env.get('torch', '—')}"]
    else:
        where = [f"GPU {env.get('gpu', '—')}", f"driver {env.get('driver', '—')}", f"torch {env.get('torch', '—')}",
                 f"Triton {env.get('triton', '—')}", f"CUDA {env.get('cuda', '—')}"]
    return " · ".join([*where, f"commit `{env.get('commit', '—')}`", str(env.get("date_utc", "—")), *extra])

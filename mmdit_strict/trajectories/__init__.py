"""Trajectories: rollout → recompute → compare → localize → report."""

from .artifact import Trajectory, TrajectoryError, read, write
from .compare import Comparison, FirstDrift, compare
from .localize import Localization, localize
from .recompute import run_recompute
from .report import summary_line, write_report
from .rollout import run_rollout

__all__ = [
    "Trajectory", "TrajectoryError", "read", "write", "Comparison", "FirstDrift", "compare", "Localization",
    "localize", "run_recompute", "run_rollout", "summary_line", "write_report",
]

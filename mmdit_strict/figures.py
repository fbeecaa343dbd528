"""Figures: matplotlib without a display, and PNGs written atomically (a killed run leaves the old file or none,
never half a figure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .io import atomic_write

#: One colour per phase of a Flow-GRPO epoch, shared by every figure that draws phases (``train``'s epoch costs,
#: ``bench train``), so a phase looks the same in all of them.
PHASE_COLORS = {"rollout": "#1565c0", "rewards": "#9e9e9e", "train": "#ef6c00", "optimizer": "#6a1b9a", "eval": "#2e7d32"}


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, which needs no display (CI, GPU machines, a ssh session)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: str | Path, dpi: float | str = 110) -> Path:
    """Lay ``fig`` out, write it to ``path`` as a PNG atomically (its folder made) and close it; returns ``path``.
    ``dpi="figure"`` keeps the figure's own."""
    fig.tight_layout()
    try:
        return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
    finally:
        pyplot().close(fig)

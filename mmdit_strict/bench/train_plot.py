"""The figure of a ``bench train`` report (``train_bench.png``): each engine's wall time per phase, stacked, with
its ratio to the peer's total, and each engine's peak memory, allocated and reserved, against the peer's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..figures import PHASE_COLORS, pyplot, save_png

PEER = "diffusers_peft"


def plot(report: dict[str, Any], path: str | Path) -> bool:
    """Draw ``report``'s engines into ``path`` (PNG). False when no engine has phase timings (all failed or none ran).
    The memory panel is left out where the report has no CUDA memory figures (a CPU run)."""
    engines = {name: e for name, e in report.get("engines", {}).items() if "phases" in e}
    if not engines:
        return False
    plt = pyplot()

    names = list(engines)
    ys = list(range(len(names)))[::-1]
    memory = any(e["total"].get("peak_gib") is not None for e in engines.values())
    fig, axes = plt.subplots(1, 2 if memory else 1, figsize=(11 if memory else 6.5, 0.55 * len(names) + 2.4),
                             squeeze=False)
    ax = axes[0][0]
    left = [0.0] * len(names)
    for phase in dict.fromkeys(p for e in engines.values() for p in e["phases"]):  # in the order bench train ran them
        widths = [engines[n]["phases"].get(phase, {}).get("wall_s") or 0.0 for n in names]
        ax.barh(ys, widths, left=left, color=PHASE_COLORS[phase], label=phase)
        left = [a + b for a, b in zip(left, widths)]
    peer_total = engines[PEER]["total"]["wall_s"] if PEER in engines else None
    for y, name, total in zip(ys, names, left):
        ratio = f" = {total / peer_total:.2f}× the peer" if peer_total and name != PEER else ""
        ax.text(total, y, f" {total:.1f} s{ratio}", va="center", fontsize=8)
    ax.set_yticks(ys, names, fontsize=8)
    ax.set_xlim(0, max(left) * 1.45)
    ax.set_xlabel("wall seconds of the timed update, by phase")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=3, frameon=False)
    if memory:
        ax = axes[0][1]
        h = 0.38
        for offset, key, color, label in ((h / 2, "peak_gib", "#2e7d32", "allocated"),
                                          (-h / 2, "peak_reserved_gib", "#a5d6a7", "reserved")):
            values = [engines[n]["total"].get(key) or 0.0 for n in names]
            ax.barh([y + offset for y in ys], values, height=h, color=color, label=label)
            for y, v in zip(ys, values):
                ax.text(v, y + offset, f" {v:.2f}", va="center", fontsize=7)
        if PEER in engines and engines[PEER]["total"].get("peak_gib") is not None:
            ax.axvline(engines[PEER]["total"]["peak_gib"], color="#555555", linestyle="--", linewidth=0.8,
                       label="the peer's allocated peak")
        top = max(max(e["total"].get("peak_gib") or 0.0, e["total"].get("peak_reserved_gib") or 0.0)
                  for e in engines.values())
        ax.set_xlim(0, top * 1.25 or 1.0)
        ax.set_yticks(ys, names, fontsize=8)
        ax.set_xlabel("peak GPU memory of the update, GiB")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=3, frameon=False)
    c, env = report.get("config", {}), report.get("environment", {})
    fig.suptitle(f"One Flow-GRPO update, {c.get('layers', '?')} blocks, grid {c.get('grid', '?')} · "
                 f"{env.get('gpu') or 'CPU'} · commit {str(env.get('commit', '?'))[:7]}", fontsize=9)
    save_png(fig, path)
    return True

"""The ablation's report: ``report.md`` (one table at a glance, then the runtime combinations),
``report.json`` (the same rows as fields) and two plots of the combinations.

``report.json``::

    summary, passed            one line; true when every entry passed
    probes, controls,          the rows of ``judge.judge`` by kind, each with name, kind, expected,
    combinations               first_drift (null: byte-identical), passed, reason, and the logp figures
    failures                   "name: reason" of every entry that failed or could not run
    reward, setup, plots, environment
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ..environment import environment_line, run_environment
from ..figures import pyplot, save_png
from ..io import atomic_write_text
from .plan import model_blocks

PLOTS = {"drift_per_step": "combinations_drift_per_step.png", "ratio_per_step": "combinations_ratio_per_step.png"}


def _num(v: Any) -> str:
    if v is None:
        return "—"
    return "0" if v == 0 else f"{v:.3e}"


def observed(row: dict[str, Any]) -> str:
    """The observed first drift in one cell: the operator key, then step and row (``identical`` when none)."""
    if row["status"] == "error":
        return "— (error)"
    d = row.get("first_drift")
    if d is None:
        return "identical"
    if d.get("key"):
        block = f"block {d['block']}" if d.get("block") is not None else "no block"
        return f"`{d['key']}` (step {d['step']}, {block}, row {d['row']})"
    return f"{d['quantity']} at step {d['step']}, sample {d['sample_id']} (no operator named)"


def _verdict(row: dict[str, Any]) -> str:
    if row["passed"]:
        return "pass"
    return f"**FAIL**: {row['reason']}" if row["status"] == "failed" else f"**ERROR**: {row['reason']}"


def _setup(cfg: DictConfig) -> dict[str, Any]:
    m, s, r, c = cfg.model, cfg.sampler, cfg.rollout, cfg.recompute
    return {"model": m.preset, "num_layers": model_blocks(m), "checkpoint": m.checkpoint, "dtype": m.dtype, "device": m.device,
            "steps": s.num_steps, "size": [s.height, s.width], "cfg_scale": s.cfg_scale, "prompts": cfg.prompts.num_prompts,
            "rollout": {"runtime": r.runtime or cfg.runtime.mode, "batch_size": r.batch_size, "cfg_layout": r.cfg_layout},
            "recompute": {"runtime": c.runtime or cfg.runtime.mode, "micro_batch": c.micro_batch, "shuffle": c.shuffle,
                          "cfg_layout": c.cfg_layout, "autograd": c.autograd, "grad_checkpointing": c.grad_checkpointing}}


def _floor(curves: list[list[float]]) -> float:
    """Where a zero (byte-identical) is drawn on a log axis: a decade power 100× below the smallest drift shown."""
    import math

    positive = [v for c in curves for v in c if v > 0]
    if not positive:
        return 1e-12
    return 10.0 ** (math.floor(math.log10(min(positive))) - 2)


_STYLES = ("o-", "s--", "^-.", "d:", "v-", "x--")


def _step_lines(ax: Any, combos: list[dict[str, Any]], curves: list[list[float]]) -> float:
    """One log-scale line per combination over the denoising steps (zeros drawn at the returned floor)."""
    import matplotlib.ticker

    floor = _floor(curves)
    for i, (r, vals) in enumerate(zip(combos, curves)):
        ax.semilogy(range(len(vals)), [max(v, floor) for v in vals], _STYLES[i % len(_STYLES)], label=r["name"])
    ax.set_xlabel("denoising step")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    return floor


def _plot(rows: list[dict[str, Any]], out: Path) -> dict[str, str]:
    combos = [r for r in rows if r.get("curves")]
    if not combos:
        return {}
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, q in zip(axes, ("v", "x", "logp")):
        floor = _step_lines(ax, combos, [r["curves"][f"{q}_max_abs"] for r in combos])
        ax.set_title(f"{q}: max |Δ| per step (0 drawn at {floor:.0e})", fontsize=10)
    axes[0].legend(fontsize=8)
    save_png(fig, out / PLOTS["drift_per_step"])

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    floor = _step_lines(ax, combos, [r.get("ratio_dev_per_step") or [] for r in combos])
    ax.set_title(f"GRPO ratio: max |ratio − 1| per step (0 drawn at {floor:.0e})", fontsize=10)
    ax.legend(fontsize=8)
    save_png(fig, out / PLOTS["ratio_per_step"])
    return dict(PLOTS)


def summary_line(rows: list[dict[str, Any]]) -> str:
    bad = [r for r in rows if not r["passed"]]
    kinds = {k: sum(r["kind"] == k for r in rows) for k in ("probe", "control", "combination")}
    what = f"{kinds['probe']} probes, {kinds['control']} controls, {kinds['combination']} combinations"
    if not bad:
        return f"ablate: all {len(rows)} entries passed ({what})"
    return f"ablate: {len(bad)} of {len(rows)} entries did not pass ({what}): {', '.join(r['name'] for r in bad)}"


def write_report(out_dir: str | Path, rows: list[dict[str, Any]], cfg: DictConfig) -> dict[str, Any]:
    """Write ``report.md``, ``report.json`` and the plots into ``out_dir``; return the JSON payload."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in PLOTS.values():  # a plot this run does not draw must not survive from an earlier one
        (out / name).unlink(missing_ok=True)
    payload = {
        "summary": summary_line(rows),
        "passed": all(r["passed"] for r in rows),
        "probes": [r for r in rows if r["kind"] == "probe"],
        "controls": [r for r in rows if r["kind"] == "control"],
        "combinations": [r for r in rows if r["kind"] == "combination"],
        "failures": [f"{r['name']}: {r['reason']}" for r in rows if not r["passed"]],
        "reward": str(cfg.ablation.reward),
        "setup": _setup(cfg),
        "plots": _plot(rows, out),
        "environment": run_environment(str(cfg.model.device)),
    }
    atomic_write_text(out / "report.json", json.dumps(payload, indent=2, default=str))
    atomic_write_text(out / "report.md", render_markdown(payload, rows))
    return payload


def _combination_lines(p: dict[str, Any]) -> list[str]:
    combos = p["combinations"]
    if not combos:
        return []
    reward = p["reward"]
    lines = ["## Rollout runtime × recompute runtime", "",
             "Each side replays the same inputs (prompt embeddings, initial latents, sigma table, keyed noise); the "
             "recompute trains as configured (its backward is the GRPO update's gradient pass). Production is `runtime=off`.", "",
             f"| entry | rollout / recompute | expected | first drift | logp values differing in any byte | max \\|ratio−1\\| "
             f"| max KL | reward ({reward}) rollout / recompute | pass |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in combos:
        if r["status"] == "error":
            lines.append(f"| {r['name']} | — | {r['expected']} | — | — | — | — | — | {_verdict(r)} |")
            continue
        rw = r.get("reward") or {}
        reward_cell = (f"{rw['rollout_mean']:+.6f} / {rw['recompute_mean']:+.6f} (max \\|Δ\\| {_num(rw['max_abs_diff'])})"
                       if rw else "—")
        lines.append(f"| {r['name']} | {' / '.join(r['runtimes'])} | {r['expected']} | {observed(r)} | "
                     f"{r['logp_bytes_differ']} of {r['logp_values']} | {_num(r['max_ratio_dev'])} | {_num(r['kl_max'])} | "
                     f"{reward_cell} | {_verdict(r)} |")
    lines.append("")
    for key, title in (("drift_per_step", "drift per step"), ("ratio_per_step", "|ratio − 1| per step")):
        if key in p["plots"]:
            lines.append(f"![{title}]({p['plots'][key]})")
    lines += ["", "Where the time went (seconds; the model includes the recompute's backward):", "",
              "| entry | side | wall | model | CFG | scheduler | communication | text encoder | VAE |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in combos:
        for side, t in (r.get("time_split") or {}).items():
            def sec(k: str) -> str:
                return f"{t[k]:.3f}" if isinstance(t.get(k), (int, float)) else "not recorded"
            lines.append(f"| {r['name']} | {side} | {sec('wall')} | {sec('model')} | {sec('cfg')} | {sec('scheduler')} | "
                         f"0 (one process) | not run | not run |")
    lines += ["", "Text encoder and VAE: not run (the prompts are given as embeddings, and latents are compared, "
              "not decoded images); communication: none, every job runs in one process."]
    return lines


def render_markdown(p: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    s = p["setup"]
    layers = f"{s['num_layers']} blocks" if s["num_layers"] else "blocks of the checkpoint"
    lines = ["# mmdit-strict ablate", "", f"**{p['summary']}**", "",
             "| entry | kind | expected | observed first drift: operator (step, block, row) | max \\|Δlogp\\| | max \\|ratio−1\\| | pass |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['kind']} | {r['expected']} | {observed(r)} | {_num(r.get('max_abs_dlogp'))} | "
                     f"{_num(r.get('max_ratio_dev'))} | {_verdict(r)} |")
    lines += ["", f"Setup: {s['model']} ({layers}), {s['dtype']} on {s['device']}, {s['steps']} steps, {s['prompts']} prompts, "
              f"{s['size'][0]}×{s['size'][1]}, CFG {s['cfg_scale']}. Baseline: rollout {s['rollout']['runtime']} "
              f"(batch {s['rollout']['batch_size']}, {s['rollout']['cfg_layout']} CFG); recompute {s['recompute']['runtime']} "
              f"(micro-batches of {s['recompute']['micro_batch']}, shuffled={s['recompute']['shuffle']}, "
              f"{s['recompute']['cfg_layout']} CFG, autograd={s['recompute']['autograd']}, "
              f"gradient checkpointing={s['recompute']['grad_checkpointing']}); each entry changes what its row names "
              "(`ablation.yaml`, and its folder's `config.yaml`)."]
    if p.get("environment"):
        lines.append(f"Ran on: {environment_line(p['environment'])}")
    lines += ["", "max |Δlogp| and max |ratio−1| are over every step and sample, in FP64 of the FP32 logp values "
              "(ratio = exp(logp_recompute − logp_rollout)); a ratio that rounds to 1.0 in FP32 does not show equal bytes: "
              "the combinations count the logp values that differ in any byte.", ""]
    lines += _combination_lines(p)
    if p["failures"]:
        lines += ["", "## Did not pass", ""] + [f"- {f}" for f in p["failures"]]
    lines += ["", "## Reading the table", "",
              "- **probe**: a deliberate mismatch on one side (a registered perturbation, or a change made only in the "
              "config); it passes when the localizer's first drifting operator is the one it declares.",
              "- **control**: a change the strict runtime must not see (batch size, padding, CFG layout, autograd, ...); "
              "it passes when every v, x and logp is byte-identical.",
              "- **combination**: rollout and recompute runtimes; strict/strict must be byte-identical, the others drift.",
              "- Each entry's own report (per-step drift, the localized operator) is in `<entry>/report/report.md`."]
    return "\n".join(lines) + "\n"

"""Reports: markdown + JSON + PNG plots of a comparison (readable in a terminal and on GitHub)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..environment import environment_line
from ..figures import pyplot, save_png
from ..io import atomic_write_text
from .artifact import Trajectory
from .compare import Comparison
from .localize import Localization


def _plot_steps(comp: Comparison, path: Path) -> bool:
    if not comp.curves:
        return False
    plt = pyplot()
    import matplotlib.ticker

    steps = list(range(comp.steps))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for q, style in (("v", "o-"), ("x", "s-"), ("logp", "^-")):
        vals = [max(v, 1e-30) for v in comp.curves[f"{q}_max_abs"]]
        axes[0].semilogy(steps, vals, style, label=f"{q} max |Δ|")
    for ax in axes:
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axes[0].set_xlabel("denoising step")
    axes[0].set_title("drift per step (1e-30 = byte-identical)")
    axes[0].legend()
    axes[1].semilogy(steps, [max(v, 1e-30) for v in comp.curves["kl_mean"]], "o-", label="mean over samples")
    axes[1].semilogy(steps, [max(v, 1e-30) for v in comp.curves["kl_max"]], "s--", label="max over samples")
    axes[1].set_xlabel("denoising step")
    axes[1].set_title("KL(rollout ‖ recompute) of the SDE transition")
    axes[1].legend()
    save_png(fig, path)
    return True


def _plot_blocks(loc: Localization, path: Path) -> bool:
    if not loc.block_drift:
        return False
    plt = pyplot()
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.semilogy(range(len(loc.block_drift)), [max(v, 1e-30) for v in loc.block_drift], "o-")
    ax.set_xlabel("block")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("max |Δ| image stream")
    ax.set_title(f"drift per block, step {loc.step}, sample {loc.sample_id}")
    save_png(fig, path)
    return True


def _plot_audit(rollout: Trajectory, recompute: Trajectory, path: Path) -> bool:
    """runtime=audit: how far the production path drifts from strict, per block and stream."""
    audits = [(name, t.manifest.get("audit")) for name, t in (("rollout", rollout), ("recompute", recompute))]
    audits = [(n, a) for n, a in audits if a]
    if not audits:
        return False
    plt = pyplot()
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for name, a in audits:
        blocks = range(len(a["per_block_max_abs"]))
        for stream, style in (("img", "o-"), ("txt", "s--")):
            ax.semilogy(blocks, [max(b[stream], 1e-30) for b in a["per_block_max_abs"]], style, label=f"{name} {stream}")
    ax.set_xlabel("block")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("max |production − strict|")
    ax.set_title("audit: production drift per block")
    ax.legend(fontsize=8)
    save_png(fig, path)
    return True


def summary_line(comp: Comparison, loc: Localization | None = None) -> str:
    if comp.byte_identical:
        return f"byte-identical: {comp.steps} steps × {comp.samples} samples, v_t, x_t and logp_t equal in every byte"
    f = comp.first
    assert f is not None
    line = f"DRIFT: first at step {f.step} (sigma {f.sigma:.4f}), sample {f.sample_id}, {f.quantity}"
    if getattr(f, "owners", None):  # torchrun artifacts: the owning rank on each side
        line = f"DRIFT: first at step {f.step} (sigma {f.sigma:.4f}), sample {f.sample_id} ({f.owners}), {f.quantity}"
    if f.max_abs is not None:
        line += f" (max |Δ| {f.max_abs:.3e}, {f.max_ulp} ULP)"
    if f.block is not None:
        line += f"; first differing block hash: block {f.block}"
    if loc is not None and loc.first is not None:
        o = loc.first
        where = f"block {o.block} " if o.block is not None else ""
        context = "sampling chain" if o.branch == "sampling" else f"{where}{o.stream} stream, {o.branch} branch"
        row = f"row {o.logical_row}"
        if getattr(o, "region", "") == "conditioning image":  # edit: the input image's tokens, not the noisy latent's
            which = (f"conditioning image {getattr(o, 'region_image', 0) + 1} of {o.region_images}"
                     if getattr(o, "region_images", 1) > 1 else "conditioning image")
            row += f" ({which} row {o.region_row}, not the noisy latent)"
        if getattr(o, "owners", ""):  # model-parallel sides: who computed that row
            row += f" [{o.owners}]"
        line += (f"; first operator: {o.operator} ({context}), "
                 f"{row}, element {o.element}, max |Δ| {o.max_abs:.3e}, {o.max_ulp} ULP")
    return line


PLOTS = ("drift_per_step.png", "drift_per_block.png", "audit_per_block.png")


def _peer_summary(peer: dict[str, Any] | None, rollout: Trajectory, phases: dict[str, float]) -> dict[str, Any] | None:
    """The peer loop's timing against the rollout's, and how far its final latents are from ours."""
    if peer is None:
        return None
    out = {k: v for k, v in peer.items() if k != "x_final"}
    ours = rollout.manifest["wall_seconds"]
    out["rollout_wall_seconds"] = ours
    out["rollout_vs_peer"] = ours / peer["wall_seconds"] if peer["wall_seconds"] else None
    if "compile" in phases:  # one-off costs included on both sides: our compile phase, the peer's warm-up step
        out["with_compile_vs_peer"] = (ours + phases["compile"]) / (peer["wall_seconds"] + peer["warmup_seconds"])
    steps = rollout.manifest["side"].get("step_seconds") or []
    if len(steps) > 1 and len(peer["step_seconds"]) > 1:  # step 0 holds the one-off JIT compile / graph capture
        out["later_steps_vs_peer"] = sum(steps[1:]) / sum(peer["step_seconds"][1:])
    if rollout.has_tensors() and "x_final" in peer:
        ref = rollout.tensors["x"][-1].float()
        out["x_final_max_abs_vs_ours"] = float((peer["x_final"] - ref).abs().max())
    return out


def write_report(out_dir: str | Path, rollout: Trajectory, recompute: Trajectory, comp: Comparison,
                 loc: Localization | None = None, *, phases: dict[str, float] | None = None,
                 peer: dict[str, Any] | None = None, environment: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``report.md``, ``report.json`` and plots into ``out_dir``; return the JSON payload.

    ``phases``: wall seconds per phase of the run (build, hash_weights, rollout, peer_rollout,
    recompute, compare); ``peer``: :func:`~mmdit_strict.trajectories.peer.peer_rollout`'s result;
    ``environment``: where the run executed (:func:`~mmdit_strict.environment.run_environment`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in PLOTS:  # a plot this comparison does not draw must not survive from an earlier one
        (out / name).unlink(missing_ok=True)
    plots = {}
    if _plot_steps(comp, out / "drift_per_step.png"):
        plots["per_step"] = "drift_per_step.png"
    if loc is not None and _plot_blocks(loc, out / "drift_per_block.png"):
        plots["per_block"] = "drift_per_block.png"
    if _plot_audit(rollout, recompute, out / "audit_per_block.png"):
        plots["audit_per_block"] = "audit_per_block.png"
    ra, rb = rollout.manifest, recompute.manifest
    payload = {
        "summary": summary_line(comp, loc),
        "byte_identical": comp.byte_identical,
        "comparison": comp.to_dict(),
        "localization": loc.to_dict() if loc else None,
        "sides": {
            name: {"runtime": m["runtime"], "side": {k: v for k, v in m["side"].items() if k != "order"},
                   "trace": m["trace"], "wall_seconds": m["wall_seconds"], "fingerprint": m["fingerprint"],
                   "audit": m.get("audit")}
            for name, m in (("rollout", ra), ("recompute", rb))
        },
        "plots": plots,
        "sigma_table": ra["sigma_table"],
        "phases": {k: round(v, 3) for k, v in (phases or {}).items()},
        "peer": _peer_summary(peer, rollout, phases or {}),
        "environment": environment,
    }
    atomic_write_text(out / "report.json", json.dumps(payload, indent=2, default=str))
    atomic_write_text(out / "report.md", render_markdown(payload, comp))
    return payload


def _graphs(stats: dict[str, dict[str, int]] | None) -> str:
    """``forward 2 / 18, training 4 / 36 (0 uncaptured)``: the side model's graph use (``model.graphs.graph_stats``)."""
    if not stats:
        return "off"
    parts = [f"{kind} {s['captures']} / {s['replays']}" + (f" ({s['uncaptured']} uncaptured)" if "uncaptured" in s else "")
             for kind, s in stats.items()]
    return ", ".join(parts)


def render_markdown(p: dict[str, Any], comp: Comparison) -> str:
    lines = ["# mmdit-strict: rollout vs recompute", "", f"**{p['summary']}**", ""]
    if p.get("environment"):
        lines += [f"Ran on: {environment_line(p['environment'])}", ""]
    lines += ["| | rollout | recompute |", "|---|---|---|"]
    ra, rb = p["sides"]["rollout"], p["sides"]["recompute"]
    lines.append(f"| runtime | {ra['runtime']} | {rb['runtime']} |")
    lines.append(f"| batching | batch {ra['side'].get('batch_size')}, CFG {ra['side'].get('cfg_layout')} | "
                 f"micro-batch {rb['side'].get('micro_batch')}, shuffled={rb['side'].get('shuffle')}, CFG {rb['side'].get('cfg_layout')} |")
    lines.append(f"| autograd / checkpointing | no / no | {rb['side'].get('autograd')} / {rb['side'].get('grad_checkpointing')} |")
    lines.append(f"| operators (calls) | {ra['trace']['operators']} ({ra['trace']['calls']}) | {rb['trace']['operators']} ({rb['trace']['calls']}) |")
    lines.append(f"| backends | {', '.join(ra['trace']['backends'])} | {', '.join(rb['trace']['backends'])} |")
    lines.append(f"| fallbacks | {len(ra['trace']['fallbacks'])} | {len(rb['trace']['fallbacks'])} |")
    lines.append(f"| wall time | {ra['wall_seconds']} s | {rb['wall_seconds']} s |")
    if ra["side"].get("cuda_graphs") or rb["side"].get("cuda_graphs"):
        lines.append(f"| CUDA graphs: captures / replays | {_graphs(ra['side'].get('cuda_graphs'))} | "
                     f"{_graphs(rb['side'].get('cuda_graphs'))} |")
    if ra.get("audit") or rb.get("audit"):
        def audit(a: Any) -> str:
            return f"max {a['max_abs_drift']:.3e} over {a['forwards']} forwards" if a else "—"
        lines.append(f"| audit: production vs strict | {audit(ra.get('audit'))} | {audit(rb.get('audit'))} |")
    steps = ra["side"].get("step_seconds") or []
    if len(steps) > 1:
        lines.append(f"| rollout step 0 (JIT compile, graph capture) / later steps mean | {steps[0]:.3f} s / "
                     f"{sum(steps[1:]) / (len(steps) - 1):.3f} s | |")
    lines.append("")
    if p.get("phases"):
        lines += ["| phase | " + " | ".join(p["phases"]) + " |", "|---" * (len(p["phases"]) + 1) + "|",
                  "| wall s | " + " | ".join(f"{v:.2f}" for v in p["phases"].values()) + " |", ""]
    peer = p.get("peer")
    if peer:
        lines.append(f"Peer: {peer['engine']}, {peer['cfg']}, batch {peer['batch_size']}: the same sampling in "
                     f"{peer['wall_seconds']:.3f} s; our rollout {peer['rollout_wall_seconds']:.3f} s = "
                     f"**{peer['rollout_vs_peer']:.2f}× the peer**"
                     + (f" (steps after the first: {peer['later_steps_vs_peer']:.2f}×)" if peer.get("later_steps_vs_peer") else "")
                     + (f"; counting our compile phase and the peer's warm-up step: {peer['with_compile_vs_peer']:.2f}×"
                        if peer.get("with_compile_vs_peer") else "")
                     + (f"; final latents max-abs vs ours {peer['x_final_max_abs_vs_ours']:.3e}" if "x_final_max_abs_vs_ours" in peer else "")
                     + ".")
        lines.append("")
    c = p["comparison"]
    lines.append(f"Compared {c['steps']} steps × {c['samples']} samples. (step, sample) pairs whose hash differs: "
                 f"v {c['differing']['v']}, x {c['differing']['x']}, logp {c['differing']['logp']}.")
    if c.get("logp_ratio"):
        r = c["logp_ratio"]
        lines.append(f"GRPO ratio exp(logp_recompute − logp_rollout) at step 0: min {r['min']:.9f}, max {r['max']:.9f}.")
    grads = rb["side"].get("lora_grads_per_step") or []
    if grads and all(g and g.get("sample_order_sha256") for g in grads):
        lines.append(f"LoRA gradients of the recompute side, folded per sample in global sample order "
                     f"(independent of micro-batch split and CFG layout): step 0 sha256 {grads[0]['sample_order_sha256'][:16]}…, "
                     f"norm {grads[0]['norm']:.6e}.")
    lines.append("")
    loc = p.get("localization")
    if loc and loc.get("first"):
        o = loc["first"]
        lines += ["## First drift", "", "| field | value |", "|---|---|"]
        for k in ("operator", "block", "stream", "branch", "logical_row", "region", "region_row", "region_image",
                  "region_images", "element", "max_abs", "max_ulp",
                  "rows_differing", "rows_total", "owners", "key"):
            if k in o and o[k] != "":  # region / region_row: reports written before edit conditioning lack them
                lines.append(f"| {k} | {o[k]} |")
        lines.append("")
    if loc and loc.get("notes"):
        lines += [f"- {n}" for n in loc["notes"]] + [""]
    if comp.curves:
        lines += ["## Drift per step", "", "| step | sigma | v max-abs | x max-abs | logp max-abs | KL mean |", "|---|---|---|---|---|---|"]
        for s in range(comp.steps):
            cv = comp.curves
            lines.append(f"| {s} | {p['sigma_table'][s]:.4f} | {cv['v_max_abs'][s]:.3e} | {cv['x_max_abs'][s]:.3e} | {cv['logp_max_abs'][s]:.3e} | {cv['kl_mean'][s]:.3e} |")
        lines.append("")
    for name, f in p["plots"].items():
        lines.append(f"![{name}]({f})")
    if c.get("warnings"):
        lines += ["", "Warnings:"] + [f"- {w}" for w in c["warnings"]]
    return "\n".join(lines) + "\n"

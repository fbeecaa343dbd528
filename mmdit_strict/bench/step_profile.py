"""Where a strict LoRA training step's GPU time goes: kernels grouped by name and launch grid.

    python -m mmdit_strict.bench.step_profile --out DIR [--layers 2] [--grid 64 64] [--txt 128] [--batch 1]
        [--forward-only]

One forward + backward (LoRA rank 64 on Flow-GRPO's targets, gradient checkpointing, ``--batch`` samples, default
1; ``--forward-only``: the no-grad forward of a rollout step instead) of the
Qwen-Image architecture cut to ``--layers`` blocks, captured (``model/train_graphs.py``; the forward alone:
``model/graphs.py``) and replayed
under the profiler. Triton kernels are one name for many products; the launch grid tells the products
apart (a product's grid is its tile count), so the table groups by ``(kernel, grid)`` and reports time
per block. A second, uncaptured step runs under the profiler with Python stacks, and each PyTorch
fill / copy / add kernel is attributed to the Python line that launched it (the glue between strict
kernels). For the captured step it also reports where the GPU waits (idle time between GPU activities by gap
size, the largest gaps) and the CUDA runtime calls on the host (a blocking call shows as a long one). Writes
``step_profile.json``, ``step_profile.md`` and ``step_profile.png`` (ms per block of the
costliest launches); ``--replot REPORT.json`` redraws a written report's figure (no GPU needed). A benchmark:
nothing here asserts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..config.arch import preset
from ..environment import environment_line, gpu_environment
from ..figures import pyplot, save_png
from .output import replot, write_report
from .timing import cuda_profiler
from .timing import gpu_gaps as timing_gaps


def _trace(fn: Callable[[], Any], stacks: bool) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity

    # CUPTI stays subscribed: nothing is timed after these profiles, and torn down between its two sessions it left
    # the process hanging after its report (torch 2.11, H100)
    with cuda_profiler(False, activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stacks) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"]


def kernels_by_grid(events: list[dict[str, Any]], layers: int, top: int) -> list[dict[str, Any]]:
    """GPU kernel events grouped by (name, grid): summed ms, launches, ms per block."""
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "kernel":
            grid = str(e.get("args", {}).get("grid", "?"))
            groups[(e["name"][:80], grid)].append(e.get("dur", 0.0) / 1e3)
    rows = [{"kernel": k, "grid": g, "ms": sum(v), "launches": len(v), "ms_per_block": sum(v) / layers}
            for (k, g), v in groups.items()]
    return sorted(rows, key=lambda r: -r["ms"])[:top]


def glue_sites(events: list[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    """PyTorch (non-Triton) kernels attributed to the innermost project line whose CPU op launched them.

    A kernel and its launching runtime call share a correlation id; the CPU op that encloses the launch
    in time on the same thread carries the Python stack (``with_stack``)."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    py = [e for e in events if e.get("cat") == "python_function"]
    by_tid: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in py:
        by_tid[e.get("tid")].append(e)
    sites: dict[tuple[str, str], list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") != "kernel" or not e["name"].startswith(("void at::", "Memcpy", "Memset")):
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        where = "?"
        if launch is not None:
            t = launch["ts"]
            frames = [f for f in by_tid.get(launch.get("tid"), []) if f["ts"] <= t <= f["ts"] + f.get("dur", 0)
                      and "mmdit_strict" in f["name"]]
            if frames:
                where = max(frames, key=lambda f: f["ts"])["name"][:110]
        sites[(e["name"][:60], where)].append(e.get("dur", 0.0) / 1e3)
    rows = [{"kernel": k, "site": s, "ms": sum(v), "launches": len(v)} for (k, s), v in sites.items()]
    return sorted(rows, key=lambda r: -r["ms"])[:top]


_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_gaps(events: list[dict[str, Any]], top: int) -> dict[str, Any]:
    """:func:`~.timing.gpu_gaps` of a trace's GPU activities (kernels, copies, fills)."""
    return timing_gaps([(e["ts"], e.get("dur", 0.0), e["name"]) for e in events if e.get("cat") in _GPU_CATS and "ts" in e],
                       top)


def host_calls(events: list[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    """CUDA runtime / driver calls of a call on the host, by name: summed ms, calls and the longest one (a
    synchronisation or a blocking graph launch shows here as a long call)."""
    groups: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            groups[e["name"][:60]].append(e.get("dur", 0.0) / 1e3)
    rows = [{"call": k, "ms": sum(v), "calls": len(v), "max_ms": max(v)} for k, v in groups.items()]
    return sorted(rows, key=lambda r: -r["ms"])[:top]


def run(layers: int, grid: tuple[int, int], txt: int, rank: int, top: int, batch: int = 1,
        backward: bool = True) -> dict[str, Any]:
    """Profile ``batch`` samples of ``txt`` prompt tokens each: forward + backward with checkpointing (the training
    step), or with ``backward=False`` the no-grad forward (a rollout step's)."""
    from ..model.init import build_model
    from .model import _attach_lora, _inputs

    arch = dataclasses.replace(preset("qwen-image"), num_layers=layers)
    model = build_model(arch, seed=0, runtime="strict", dtype=torch.bfloat16, device="cuda")
    _attach_lora(model, rank, seed=1)
    model.enable_gradient_checkpointing(True)
    inp = _inputs(arch, grid, [txt] * batch, torch.bfloat16)

    def step() -> None:
        if not backward:
            with torch.no_grad():
                model(**inp, return_dict=False)
            return
        model(**inp, return_dict=False)[0].float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    model.enable_cuda_graphs()
    step(), step()  # capture, then one replay
    captured = _trace(step, stacks=False)
    model.enable_cuda_graphs(False)
    step()
    eager = _trace(step, stacks=True)
    kern = [e for e in captured if e.get("cat") == "kernel"]
    return {
        "layers": layers, "grid": list(grid), "txt": txt, "rank": rank, "batch": batch, "backward": backward,
        "captured_kernel_ms": sum(e.get("dur", 0.0) for e in kern) / 1e3, "captured_launches": len(kern),
        "by_grid": kernels_by_grid(captured, layers, top),
        "glue": glue_sites(eager, top),
        "captured_gaps": gpu_gaps(captured, 12),
        "captured_host_calls": host_calls(captured, 12),
    }


def plot(report: dict[str, Any], path: str | Path, top: int = 16) -> bool:
    """Horizontal bars: ms per block of the ``top`` costliest (kernel, grid) groups of the captured step. Writes
    ``path`` (PNG); False when the report has no kernel group."""
    rows = report.get("by_grid", [])[:top]
    if not rows:
        return False
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8.5, 0.32 * len(rows) + 1.3))
    ys = list(range(len(rows)))[::-1]
    ax.barh(ys, [r["ms_per_block"] for r in rows], color="#1565c0")
    for y, r in zip(ys, rows):
        ax.text(r["ms_per_block"], y, f" {r['ms_per_block']:.2f} ({r['launches']} launches in {report['layers']} blocks)",
                va="center", fontsize=7)
    ax.set_yticks(ys, [f"{r['kernel'][:40]} {r['grid']}" for r in rows], fontsize=7)
    ax.set_xlabel(f"ms of kernel time per block ({_what(report)})")
    env = report.get("environment", {})
    ax.set_title(f"{report['captured_kernel_ms'] / report['layers']:.2f} ms per block, grid {report['grid']}, "
                 f"rank {report['rank']} · {env.get('gpu', '')} · commit {str(env.get('commit', '?'))[:7]}", fontsize=9)
    ax.set_xlim(0, max(r["ms_per_block"] for r in rows) * 1.35)
    save_png(fig, path)
    return True


def _what(report: dict[str, Any]) -> str:
    """What was profiled; a report without ``batch`` and ``backward`` is of a B = 1 training step."""
    kind = "LoRA training step" if report.get("backward", True) else "no-grad forward"
    return f"captured {kind}, B = {report.get('batch', 1)}"


def render(report: dict[str, Any]) -> str:
    lines = [f"# Strict {_what(report)}, kernel time by launch ({report['layers']} blocks, grid {report['grid']}, "
             f"{report['txt']} text tokens, rank {report['rank']})", "", environment_line(report["environment"]), "",
             f"Captured step: {report['captured_kernel_ms']:.1f} ms of kernels in {report['captured_launches']} launches "
             f"({report['captured_kernel_ms'] / report['layers']:.2f} ms per block, embeddings and output included).", "",
             "| kernel | grid | ms | launches | ms per block |", "|---|---|---|---|---|"]
    lines += [f"| `{r['kernel']}` | {r['grid']} | {r['ms']:.2f} | {r['launches']} | {r['ms_per_block']:.3f} |"
              for r in report["by_grid"]]
    lines += ["", "## PyTorch kernels of the uncaptured step, by launching line", "",
              "| kernel | launched from | ms | launches |", "|---|---|---|---|"]
    lines += [f"| `{r['kernel']}` | `{r['site']}` | {r['ms']:.2f} | {r['launches']} |" for r in report["glue"]]
    gaps = report.get("captured_gaps")
    if gaps and gaps["span_ms"]:
        lines += ["", "## Where the captured step's GPU waits", "",
                  f"GPU span {gaps['span_ms']:.2f} ms: busy {gaps['busy_ms']:.2f}, idle {gaps['idle_ms']:.2f} "
                  "(between GPU activities, by gap size).", "", "| gap | gaps | idle ms |", "|---|---|---|"]
        lines += [f"| {c['from_us']:.0f}–{c['to_us']:.0f} µs | {c['gaps']} | {c['idle_ms']:.3f} |".replace("–inf µs", " µs or more")
                  for c in gaps["classes"]]
        lines += ["", "| largest gaps µs | after | before |", "|---|---|---|"]
        lines += [f"| {g['us']:.1f} | `{g['after']}` | `{g['before']}` |" for g in gaps["largest"]]
    if report.get("captured_host_calls"):
        lines += ["", "## CUDA runtime calls of the captured step (host)", "",
                  "| call | ms | calls | longest ms |", "|---|---|---|---|"]
        lines += [f"| `{r['call']}` | {r['ms']:.3f} | {r['calls']} | {r['max_ms']:.3f} |" for r in report["captured_host_calls"]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmdit_strict.bench.step_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="experiments/local", help="output folder")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--grid", type=int, nargs=2, default=(64, 64))
    p.add_argument("--txt", type=int, default=128)
    p.add_argument("--lora-rank", type=int, default=64)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--batch", type=int, default=1,
                   help="samples per step, each of --txt tokens (2: a training micro-batch of one pair with CFG batched)")
    p.add_argument("--forward-only", action="store_true",
                   help="profile the no-grad forward (a rollout step's) instead of forward + backward")
    p.add_argument("--replot", default=None, metavar="REPORT.json",
                   help="only redraw the figure of a written report (step_profile.png beside it); no GPU needed")
    args = p.parse_args(argv)
    if args.replot:
        return replot(args.replot, plot, "bench.step_profile", "no kernel group to draw")
    if args.batch < 1:
        p.error(f"--batch must be >= 1, got {args.batch}")
    if not torch.cuda.is_available():
        raise SystemExit("bench.step_profile needs a CUDA GPU")
    report = run(args.layers, tuple(args.grid), args.txt, args.lora_rank, args.top, args.batch, not args.forward_only)
    report["environment"] = gpu_environment()
    print(write_report(args.out, "step_profile", report, render))
    plot(report, Path(args.out) / "step_profile.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

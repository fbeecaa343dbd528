"""CPU strict vs production forward of the tiny model on this CPU (the budget: strict ≤ 3× production).

    python -m mmdit_strict.bench.cpu_strict --out DIR [--repeats 21] [--warmup 3] [--backward]

For each shape the two runtimes run on the same model and inputs, interleaved (strict, production,
strict, ...) so that background load hits both alike; the report gives median, min and interquartile
range per runtime, and the ratio of medians. ``--backward`` also times forward + backward (parameter
gradients), the training-recompute cost. Writes ``DIR/cpu_strict_bench.json`` and
``DIR/cpu_strict_bench.md`` with the CPU, thread count, load average, torch version and commit.
This is a benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..model.inputs import random_inputs
from ..environment import commit as measured_commit

# name → (batch, latent grid (h, w) in tokens, valid text tokens per sample, padded text length)
SHAPES: dict[str, tuple[int, tuple[int, int], tuple[int, ...], int]] = {
    "b1_8x8": (1, (8, 8), (12,), 12),
    # the main job's default: 128x128 images (8x8 tokens), 2 prompts with true CFG → batch 4
    "main_job_cfg_b4_8x8": (4, (8, 8), (12, 20, 5, 9), 20),
    "b8_16x16": (8, (16, 16), (7, 31, 12, 40, 3, 25, 18, 33), 40),
}


def _env() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = measured_commit()
    try:
        # the bench's own outputs under experiments/ do not make the measured code dirty
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", ".", ":!experiments"], capture_output=True,
                                    text=True, cwd=Path(__file__).resolve().parents[2]).stdout.strip())
    except OSError:
        dirty = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit,
        "worktree_dirty": dirty,
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _stats(times: list[float]) -> dict[str, float]:
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
            "q1_ms": 1e3 * q[0], "q3_ms": 1e3 * q[2], "n": len(times)}


def _time_interleaved(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int) -> dict[str, dict[str, float]]:
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: _stats(v) for k, v in times.items()}


def diffusers_peer(model) -> Any | None:
    """diffusers' QwenImageTransformer2DModel holding the same weights (None when diffusers is absent)."""
    try:
        from diffusers import QwenImageTransformer2DModel
    except ImportError:
        return None
    cfg = {k: v for k, v in model.config.to_diffusers_config().items() if not k.startswith("_")}
    peer = QwenImageTransformer2DModel(**cfg).to(dtype=model.dtype)
    peer.load_state_dict(model.state_dict(), strict=True)
    return peer.eval()


def run(model, shapes: dict[str, tuple], repeats: int, warmup: int, backward: bool) -> list[dict[str, Any]]:
    rows = []
    peer = diffusers_peer(model)
    for name, (batch, grid, lens, pad) in shapes.items():
        inputs = random_inputs(model.config, grid, lens, pad_to=pad, sigmas=torch.linspace(0.95, 0.2, batch).tolist())

        def forward(runtime: str) -> Callable[[], Any]:
            def fn() -> Any:
                model.set_runtime(runtime)
                with torch.no_grad():
                    return model(**inputs).sample
            return fn

        def train_step(runtime: str) -> Callable[[], Any]:
            params = [p for p in model.parameters() if p.requires_grad]

            def fn() -> Any:
                model.set_runtime(runtime)
                out = model(**inputs).sample
                return torch.autograd.grad(out.square().mean(), params, allow_unused=True)
            return fn

        row: dict[str, Any] = {"shape": name, "batch": batch, "grid": list(grid), "image_tokens": grid[0] * grid[1],
                               "text_lengths": list(lens), "padded_text_length": pad}
        fns = {"strict": forward("strict"), "production": forward("off")}
        if peer is not None:
            def diffusers_fn() -> Any:
                with torch.no_grad():
                    return peer(**inputs).sample
            fns["diffusers"] = diffusers_fn
        fwd = _time_interleaved(fns, repeats, warmup)
        row["forward"] = {**fwd, "ratio_strict_over_production": fwd["strict"]["median_ms"] / fwd["production"]["median_ms"]}
        if "diffusers" in fwd:
            row["forward"]["ratio_strict_over_diffusers"] = fwd["strict"]["median_ms"] / fwd["diffusers"]["median_ms"]
        if backward:
            bwd = _time_interleaved({"strict": train_step("strict"), "production": train_step("off")}, max(3, repeats // 2), 1)
            row["forward_backward"] = {**bwd, "ratio_strict_over_production": bwd["strict"]["median_ms"] / bwd["production"]["median_ms"]}
        rows.append(row)
    model.set_runtime("off")
    return rows


def to_markdown(report: dict[str, Any]) -> str:
    env = report["env"]
    lines = [
        "# CPU strict vs production forward (tiny model)",
        "",
        f"CPU: {env['cpu']} ({env['cores']} cores, torch default threads {env['torch_threads']}); torch {env['torch']}; "
        f"commit {env['commit']}{' (dirty worktree)' if env.get('worktree_dirty') else ''}; "
        f"load average at start {env['load_average_at_start']}, at end {env.get('load_average_at_end')}; {env['time']}.",
        f"Model: `{report['model']}`; {report['repeats']} interleaved repeats after {report['warmup']} warm-up runs; "
        "times are medians (min, interquartile range).",
        "",
        "| threads | shape | B | image tokens | kind | strict ms | production ms | strict / production | diffusers eager ms | strict / diffusers |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        for kind in ("forward", "forward_backward"):
            if kind not in r:
                continue
            s, p = r[kind]["strict"], r[kind]["production"]
            lines.append(
                f"| {r['threads']} | {r['shape']} | {r['batch']} | {r['image_tokens']} | {kind.replace('_', ' + ')} | "
                f"{s['median_ms']:.2f} ({s['min_ms']:.2f}, {s['q1_ms']:.2f}–{s['q3_ms']:.2f}) | "
                f"{p['median_ms']:.2f} ({p['min_ms']:.2f}, {p['q1_ms']:.2f}–{p['q3_ms']:.2f}) | "
                f"**{r[kind]['ratio_strict_over_production']:.2f}×** | "
                + (f"{r[kind]['diffusers']['median_ms']:.2f} | {r[kind]['ratio_strict_over_diffusers']:.2f}× |"
                   if "diffusers" in r[kind] else "— | — |")
            )
    worst = report["worst_forward_ratio"]
    lines += ["", f"Worst forward ratio of medians: **{worst:.2f}×** (the budget is at most 3×): "
              f"{'within' if worst <= report['budget_forward_ratio'] else 'OVER'} the budget.",
              "A load average above the core count means other processes shared the CPU: medians then carry "
              "their noise (the interleaving spreads it over both runtimes; the min column is the quiet-machine figure).", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--backward", action="store_true", help="also time forward + backward")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="torch thread counts to measure, one table block each (default: torch's choice)")
    parser.add_argument("--checkpoint", default=None, help="diffusers transformer folder (default: tiny preset, seeded init)")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    args = parser.parse_args(argv)
    from ..io import atomic_write_text
    from ..model.mmdit import MMDiT

    if args.checkpoint:
        model = MMDiT.from_pretrained(args.checkpoint)
        model_name = str(args.checkpoint)
    else:
        from ..config.arch import preset
        from ..model.init import build_model

        model = build_model(preset("tiny"), seed=0)
        model_name = "preset tiny, init seed 0"
    env = _env()  # before the runs: the load average at start says whether the machine was quiet
    rows = []
    default_threads = torch.get_num_threads()
    for threads in args.threads or [default_threads]:
        torch.set_num_threads(threads)
        for row in run(model, {k: SHAPES[k] for k in args.shapes}, args.repeats, args.warmup, args.backward):
            rows.append({"threads": threads, **row})
    torch.set_num_threads(default_threads)
    report = {
        "env": env,
        "model": model_name,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "rows": rows,
        "worst_forward_ratio": max(r["forward"]["ratio_strict_over_production"] for r in rows),
        "budget_forward_ratio": 3.0,
    }
    report["env"]["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    out = Path(args.out)
    atomic_write_text(out / "cpu_strict_bench.json", json.dumps(report, indent=2) + "\n")
    atomic_write_text(out / "cpu_strict_bench.md", to_markdown(report))
    print(to_markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

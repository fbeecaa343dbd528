"""Where the uncaptured strict step's host time goes: Python functions by their own time, and by layer of the stack.

    python -m mmdit_strict.bench.host_profile --out DIR [--layers 8] [--grid 64 64] [--txt 128] [--device cuda]

An uncaptured strict forward (no autograd) and a LoRA forward + backward with gradient checkpointing (B = 1, rank
``--lora-rank`` on Flow-GRPO's targets) of the Qwen-Image architecture cut to ``--layers`` blocks, each timed
(wall per call), counted (CUDA kernel launches, on a GPU) and then run ``--calls`` times under ``cProfile``. The
report gives, per call: the profiled host time split by where the code lives (Triton's launcher, our
kernels' host code, our model, autograd and checkpointing, the rest of PyTorch's Python, built-ins such as tensor
allocation) and the functions with the most own time. cProfile inflates small functions' time, so the shares
are the figure to read, not the absolute milliseconds. On the CPU (``--device cpu``) the tiny preset runs
instead, for trying the tool; its operators then run the CPU strict backend. Writes
``host_profile.json`` and ``host_profile.md``. A benchmark: nothing here asserts.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..config.arch import preset
from ..environment import environment_line, run_environment
from .model import _attach_lora, _inputs, _kernel_profile
from .output import write_report

#: (area, path fragment) in match order: the first fragment found in a function's file names its area
AREAS: tuple[tuple[str, str], ...] = (
    ("our kernels' host code", "mmdit_strict/kernels/"),
    ("our model", "mmdit_strict/model/"),
    ("Triton launcher", "/triton/"),
    ("autograd and checkpointing", "torch/autograd/"),
    ("autograd and checkpointing", "torch/utils/checkpoint"),
    ("PyTorch Python (other)", "/torch/"),
    ("PEFT", "/peft/"),
)
BUILTIN = "built-ins and C calls (tensor ops, allocation)"
OTHER = "other"


def area_of(filename: str) -> str:
    """The stack layer a profiled function belongs to, from its file name (``~`` marks built-ins)."""
    path = filename.replace("\\", "/")
    if path == "~" or path.startswith("<built-in"):
        return BUILTIN
    for area, fragment in AREAS:
        if fragment in path:
            return area
    return OTHER


def summarize(stats: pstats.Stats, calls: int, top: int) -> dict[str, Any]:
    """Own time per area and the ``top`` functions by own time, all per profiled call (ms)."""
    areas: dict[str, float] = {}
    rows = []
    for (filename, line, name), (_, ncalls, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        area = area_of(filename)
        areas[area] = areas.get(area, 0.0) + tottime
        rows.append({"function": f"{_short(filename)}:{line}({name})", "area": area,
                     "calls": ncalls / calls, "own_ms": tottime * 1e3 / calls})
    total = sum(areas.values())
    by_area = sorted(({"area": a, "own_ms": t * 1e3 / calls, "share": t / total if total else 0.0}
                      for a, t in areas.items()), key=lambda r: -r["own_ms"])
    return {"profiled_ms": total * 1e3 / calls, "areas": by_area,
            "functions": sorted(rows, key=lambda r: -r["own_ms"])[:top]}


def _short(filename: str) -> str:
    path = filename.replace("\\", "/")
    for marker in ("site-packages/", "mmdit_strict/"):
        if marker in path:
            return (marker if marker == "mmdit_strict/" else "") + path.split(marker, 1)[1]
    return path


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def profile_call(fn: Callable[[], None], device: str, calls: int, top: int) -> dict[str, Any]:
    """Wall ms per call (after two warm-up calls), kernel launches of one call, and the cProfile summary."""
    fn(), fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    wall = (time.perf_counter() - t0) * 1e3 / calls
    launches = _kernel_profile(fn)[0] if device.startswith("cuda") else None
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    _sync(device)
    prof.disable()
    out = {"wall_ms": wall, "launches": launches, **summarize(pstats.Stats(prof), calls, top)}
    if launches:
        out["wall_us_per_launch"] = wall * 1e3 / launches
    return out


def run(layers: int, grid: tuple[int, int], txt: int, rank: int, device: str, calls: int, top: int) -> dict[str, Any]:
    from ..model.init import build_model

    on_gpu = device.startswith("cuda")
    arch = preset("qwen-image") if on_gpu else preset("tiny")
    arch = dataclasses.replace(arch, num_layers=layers)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if not on_gpu:
        grid, txt = (min(grid[0], 8), min(grid[1], 8)), min(txt, 16)
    model = build_model(arch, seed=0, runtime="strict", dtype=dtype, device=device)
    inp = _inputs(arch, grid, [txt], dtype, device)

    def forward() -> None:
        with torch.no_grad():
            model(**inp, return_dict=False)

    def step() -> None:
        model(**inp, return_dict=False)[0].float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    report: dict[str, Any] = {"layers": layers, "grid": list(grid), "txt": txt, "rank": rank, "device": device,
                              "calls": calls, "cases": {}}
    report["cases"]["forward"] = profile_call(forward, device, calls, top)
    _attach_lora(model, min(rank, arch.num_attention_heads * arch.attention_head_dim), seed=1)
    model.enable_gradient_checkpointing(True)
    report["cases"]["lora_fwd_bwd"] = profile_call(step, device, calls, top)
    return report


def render(report: dict[str, Any]) -> str:
    lines = [f"# Host time of the uncaptured strict step ({report['layers']} blocks, grid {report['grid']}, "
             f"{report['txt']} text tokens, LoRA rank {report['rank']}, {report['device']})", "",
             environment_line(report["environment"]), "",
             f"Wall time is measured without the profiler; the rest comes from {report['calls']} calls under cProfile, "
             "per call. cProfile inflates small functions: read the shares.", ""]
    for case, c in report["cases"].items():
        launches = f", {c['launches']} kernel launches, {c['wall_us_per_launch']:.1f} µs of wall per launch" if c.get("launches") else ""
        lines += [f"## {case}", "", f"Wall {c['wall_ms']:.1f} ms per call{launches}; profiled host time "
                  f"{c['profiled_ms']:.1f} ms per call.", "", "| where | own ms per call | share |", "|---|---|---|"]
        lines += [f"| {a['area']} | {a['own_ms']:.2f} | {a['share']:.1%} |" for a in c["areas"]]
        lines += ["", "| function | area | calls per call | own ms per call |", "|---|---|---|---|"]
        lines += [f"| `{f['function']}` | {f['area']} | {f['calls']:.0f} | {f['own_ms']:.2f} |" for f in c["functions"]]
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmdit_strict.bench.host_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="experiments/local", help="output folder")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks")
    p.add_argument("--grid", type=int, nargs=2, default=(64, 64), help="latent grid in tokens (GPU; the CPU caps it at 8 × 8)")
    p.add_argument("--txt", type=int, default=128, help="prompt tokens (GPU; the CPU caps it at 16)")
    p.add_argument("--lora-rank", type=int, default=64)
    p.add_argument("--device", default=None, help="cuda (default when there is a GPU) or cpu (the tiny preset)")
    p.add_argument("--calls", type=int, default=3, help="calls under the profiler (and timed) per case")
    p.add_argument("--top", type=int, default=30, help="functions listed per case")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench.host_profile: --device cuda needs a CUDA GPU")
    if args.layers < 1 or args.calls < 1:
        raise SystemExit("bench.host_profile: --layers and --calls must be at least 1")
    report = run(args.layers, tuple(args.grid), args.txt, args.lora_rank, device, args.calls, args.top)
    report["environment"] = run_environment(device)
    print(write_report(Path(args.out), "host_profile", report, render))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

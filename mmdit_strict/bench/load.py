"""Checkpoint load time: ``MMDiT.from_pretrained`` vs diffusers' ``QwenImageTransformer2DModel``, same files, same run.

    python -m mmdit_strict.bench.load --out DIR [--checkpoint PATH] [--device cuda] [--repeats 3]

Each load runs in a fresh child process (``load_child.py``: imports and the device's start happen before
the clock; the device is synchronised before it stops), so its host memory figures are its own: peak
growth of the whole resident set (mapped file pages included) and of anonymous memory. The two engines
alternate (diffusers first in even repeats, ours first in odd ones); the shards are read once before the
first load (warm page cache). diffusers runs ``from_pretrained(path, torch_dtype=...).to(device)``; ours
``MMDiT.from_pretrained(path, torch_dtype=..., device=...)``. After each clock stops the child hashes the
loaded weights (``state_dict_hash``): ours must equal diffusers', and, for a checkpoint this bench wrote,
the model it was written from.

Without ``--checkpoint`` it writes (once, then reuses from ``--cache``) a random BF16 checkpoint of
``--preset`` (default the 60-block Qwen-Image, drawn on the GPU when there is one) in ``--shards`` files
(9, as the published checkpoint). Writes ``DIR/load_bench.json`` and ``DIR/load_bench.md``. A benchmark,
not a test: nothing here asserts; the report says whether the bar (time ≤ 1.0× diffusers, host growth ≤
2 GiB, same bytes) was met.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from .output import write_report
from ..environment import environment_line, gpu_environment, run_environment
from .load_checkpoint import read_stamp
from .load_child import ENGINES
from .markdown import errors_and_wall_time, row, section

GIB = 2**30
BAR_RATIO, BAR_HOST_GIB = 1.0, 2.0
CPU_BUILD_LIMIT = 8 * 10**9  # bytes of random checkpoint this bench writes without a GPU
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def default_cache() -> Path:
    """Where a written checkpoint is kept between runs (``$XDG_CACHE_HOME/mmdit_strict/load_bench``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mmdit_strict" / "load_bench"


def _child(args: list[str], timeout_s: float) -> dict[str, Any]:
    """Run ``load_child`` with ``args``; its ``RESULT`` line, or ``{"error": ...}``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), os.environ.get("PYTHONPATH")])))
    try:
        run = subprocess.run([sys.executable, "-m", "mmdit_strict.bench.load_child", *args], capture_output=True, text=True,
                             timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    if run.returncode != 0 or not lines:
        return {"error": f"exit {run.returncode}: {(run.stderr or run.stdout).strip()[-600:]}"}
    return json.loads(lines[-1].removeprefix("RESULT "))


def checkpoint_bytes(preset_name: str, layers: int | None) -> int:
    """BF16 bytes of the checkpoint :func:`run` would write (counted on a model without storage)."""
    import dataclasses

    from ..config.arch import preset
    from ..model import MMDiT

    arch = preset(preset_name)
    if layers is not None:
        arch = dataclasses.replace(arch, num_layers=layers)
    with torch.device("meta"):
        return 2 * sum(p.numel() for p in MMDiT(arch).parameters())


def warm_page_cache(folder: Path, block: int = 64 * 2**20) -> int:
    """Read every file of ``folder`` once (into one reused buffer); returns the bytes read."""
    buf, total = bytearray(block), 0
    for f in sorted(folder.iterdir()):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while n := fh.readinto(buf):
                    total += n
    return total


def _checkpoint_facts(folder: Path) -> dict[str, Any]:
    shards = sorted(folder.glob("*.safetensors"))
    return {"path": str(folder), "shards": len(shards), "bytes": sum(f.stat().st_size for f in shards)}


def summarize(runs: list[dict[str, Any]], expected_sha: str | None) -> dict[str, Any]:
    """Per engine: median / min / max seconds and median host growth; the ratio ours/diffusers of the medians;
    whether every load gave the same weights; the bar."""
    per: dict[str, Any] = {}
    for engine in ENGINES:
        ok = [r for r in runs if r["engine"] == engine and "seconds" in r]
        if ok:
            secs = [r["seconds"] for r in ok]
            per[engine] = {"n": len(ok), "median_s": statistics.median(secs), "min_s": min(secs), "max_s": max(secs),
                           "median_rss_growth_gib": statistics.median(r["rss_growth"] for r in ok) / GIB,
                           "median_anon_growth_gib": statistics.median(r["anon_growth"] for r in ok) / GIB,
                           # a CPU target's weights are host memory by definition: the bar is on what comes beside them
                           "max_growth_beyond_weights_gib": max(r["rss_growth"] - r.get("host_weight_bytes", 0) for r in ok) / GIB}
    out: dict[str, Any] = {"engines": per}
    if "ours" in per and "diffusers" in per:
        out["ratio_ours_over_diffusers"] = per["ours"]["median_s"] / per["diffusers"]["median_s"]
    hashes = {r.get("state_sha256") for r in runs if "seconds" in r}
    out["same_bytes_every_load"] = len(hashes) == 1 and None not in hashes
    if expected_sha is not None:
        out["equals_written_model"] = hashes == {expected_sha}
    if "ratio_ours_over_diffusers" in out:
        out["bar"] = {
            "time": out["ratio_ours_over_diffusers"] <= BAR_RATIO,
            "host_memory": per["ours"]["max_growth_beyond_weights_gib"] <= BAR_HOST_GIB,
            "bytes": out["same_bytes_every_load"] and out.get("equals_written_model", True),
        }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build or find the checkpoint, warm the page cache, then time ``repeats`` alternating pairs of loads."""
    t0 = time.perf_counter()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    errors: list[str] = []
    build: dict[str, Any] | None = None
    if args.checkpoint:
        folder = Path(args.checkpoint)
    else:
        size = checkpoint_bytes(args.preset, args.layers)
        if torch.device(device).type == "cpu" and size > CPU_BUILD_LIMIT:
            raise ValueError(f"writing a {size / 1e9:.0f} GB checkpoint on the CPU is not offered: run on a GPU, pass "
                             "--checkpoint, or a smaller --preset / --layers")
        layers = f"-{args.layers}L" if args.layers is not None else ""
        folder = Path(args.cache or default_cache()) / f"{args.preset}{layers}-{args.shards}shards-bf16-{torch.device(device).type}"
        cmd = ["build", "--folder", str(folder), "--preset", args.preset, "--shards", str(args.shards), "--device", device]
        build = _child(cmd + (["--layers", str(args.layers)] if args.layers is not None else []), args.timeout_s)
        if "error" in build:
            raise RuntimeError(f"could not write the checkpoint in {folder}: {build['error']}")
    warm = time.perf_counter()
    warm_bytes = warm_page_cache(folder)
    warm_s = time.perf_counter() - warm
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        order = ENGINES if rep % 2 == 0 else tuple(reversed(ENGINES))
        for i, engine in enumerate(order):
            r = _child(["load", "--engine", engine, "--checkpoint", str(folder), "--device", device, "--dtype", args.dtype],
                       args.timeout_s)
            r.update(engine=engine, repeat=rep, position=i)
            if "error" in r:
                errors.append(f"repeat {rep} {engine}: {r['error']}")
            runs.append(r)
            print(f"repeat {rep} {engine}: " + (f"{r['seconds']:.2f} s" if "seconds" in r else "error"), flush=True)
    stamp = read_stamp(folder)
    expected = stamp.get("state_sha256") if stamp and args.dtype == "bfloat16" else None
    return {
        "device": device, "dtype": args.dtype, "repeats": args.repeats,
        "checkpoint": {**_checkpoint_facts(folder), "written_by_bench": build is not None,
                       "build_s": build.get("seconds") if build else None, "warm_read_bytes": warm_bytes, "warm_read_s": warm_s},
        "runs": runs, "summary": summarize(runs, expected), "errors": errors, "wall_s": time.perf_counter() - t0,
    }


def environment(device: str) -> dict[str, Any]:
    """:func:`run_environment` (GPU, driver, versions, commit) plus diffusers', safetensors' versions and the cores."""
    import importlib.metadata as md

    env = gpu_environment() if device.startswith("cuda") and torch.cuda.is_available() else run_environment("cpu")
    for pkg in ("diffusers", "safetensors"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            env[pkg] = None
    env["cpu_cores"] = os.cpu_count()
    return env


def _gib(b: float) -> str:
    return f"{b / GIB:.2f}"


def render(report: dict[str, Any]) -> str:
    """The markdown report: environment line, the figures that answer the question, then every load."""
    env, ck, s = report["environment"], report["checkpoint"], report["summary"]
    where = "GPU" if env.get("gpu") else "CPU only: read the ratio, not the seconds"
    lines = [
        f"# Checkpoint load: MMDiT.from_pretrained vs diffusers ({where}, {report['dtype']} onto {report['device']})",
        "",
        environment_line(env, f"diffusers {env.get('diffusers')}", f"safetensors {env.get('safetensors')}",
                         f"{env.get('cpu_cores')} CPU cores"),
        "",
        f"Checkpoint `{ck['path']}`: {ck['shards']} shards, {ck['bytes'] / 1e9:.2f} GB"
        + (f" (written by this bench in {ck['build_s']:.0f} s)" if ck.get("build_s") else "")
        + f"; read once before the first load ({ck['warm_read_s']:.1f} s). Each load in its own process, engines"
        " alternating; the clock stops after a device synchronisation. Host growth: peak over the start of the load.",
        "",
    ]
    if report["device"] == "cpu":
        lines += ["On the CPU, diffusers keeps weights whose stored dtype is the asked one as views of the mapped shards "
                  "(their pages are read at first use, after the clock stops); ours reads every byte into its own memory "
                  "and checks it finite. A cast load touches every byte on both sides.", ""]
    ratio = s.get("ratio_ours_over_diffusers")
    if ratio is not None:
        bar = s["bar"]
        lines += [f"**ours / diffusers (medians): {ratio:.2f}×** — bar ≤ {BAR_RATIO:.1f}×: {'met' if bar['time'] else 'NOT met'}; "
                  f"our peak host growth beyond the loaded weights ≤ {BAR_HOST_GIB:.0f} GiB "
                  f"({s['engines']['ours']['max_growth_beyond_weights_gib']:.2f}): {'met' if bar['host_memory'] else 'NOT met'}; "
                  f"same bytes: {'yes' if bar['bytes'] else 'NO'}.", ""]
    same = "yes" if s["same_bytes_every_load"] else "NO"
    note = f"Every load gave the same weights (state_dict_hash): {same}."
    if "equals_written_model" in s:
        note += f" Equal to the model the checkpoint was written from: {'yes' if s['equals_written_model'] else 'NO'}."
    rows = [row(e, v["n"], f"{v['median_s']:.2f}", f"{v['min_s']:.2f}", f"{v['max_s']:.2f}", f"{v['median_rss_growth_gib']:.2f}",
                f"{v['median_anon_growth_gib']:.2f}") for e, v in s["engines"].items()]
    lines += section("Summary", ["engine", "loads", "median s", "min s", "max s", "peak RSS growth GiB (median)",
                                 "peak anon growth GiB (median)"], rows, notes=[note])
    run_rows = [row(r["repeat"], r["position"] + 1, r["engine"],
                    f"{r['seconds']:.2f}" if "seconds" in r else "error", _gib(r.get("rss_growth", 0)), _gib(r.get("anon_growth", 0)),
                    r.get("memory_method", "—"), (r.get("state_sha256") or "—")[:16]) for r in report["runs"]]
    lines += section("Every load", ["repeat", "order", "engine", "s", "RSS growth GiB", "anon growth GiB", "peak from",
                                    "weights sha256"], run_rows)
    return "\n".join(lines + errors_and_wall_time(report)) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmdit_strict.bench.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="experiments/local", help="output folder")
    p.add_argument("--checkpoint", default=None, help="a diffusers transformer folder (default: write a random one)")
    p.add_argument("--device", default=None, help="where the weights go (default: cuda when there is a GPU, else cpu)")
    p.add_argument("--repeats", type=int, default=3, help="pairs of loads (engines alternate which goes first)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="torch_dtype of both loads")
    p.add_argument("--preset", default="qwen-image", help="without --checkpoint: the architecture to write")
    p.add_argument("--layers", type=int, default=None, help="without --checkpoint: blocks (default: the preset's)")
    p.add_argument("--shards", type=int, default=9, help="without --checkpoint: safetensors files to write")
    p.add_argument("--cache", default=None, help="without --checkpoint: where to keep the written checkpoint")
    p.add_argument("--timeout-s", type=float, default=900.0, help="limit for each child process")
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    report = run(args)
    report = {"environment": environment(report["device"]), **report}
    print(write_report(args.out, "load_bench", report, render))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

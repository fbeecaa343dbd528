"""Whole-model benchmark on the GPU: our transformer (each runtime) vs diffusers eager, identical weights.

    python -m mmdit_strict.bench.model --out DIR [--layers 60] [--grid 64 64] [--runtimes strict off]

Builds the Qwen-Image architecture with random BF16 weights directly on the GPU, hands the same
parameter storage to diffusers' ``QwenImageTransformer2DModel`` (``load_state_dict(assign=True)``: one
copy of the 20 B weights serves both), and times, in the same run:

* ``fwd_b1``: forward, B = 1, no autograd (a rollout step without CFG);
* ``fwd_b2_cfg``: forward, B = 2 — cond and negative prompt of different lengths in one batch (CFG);
* ``fwd_bwd_lora``: forward + backward of a LoRA (rank 64, Flow-GRPO's Qwen-Image targets) with
  gradient checkpointing, B = 1 (a training step); ``fwd_bwd_lora_b2_cfg``: the same, B = 2 (CFG).

Our ``_graph`` engines replay CUDA graphs: the forward alone without autograd (``model/graphs.py``),
forward and backward with it (``model/train_graphs.py``). ``--diffusers-compile`` adds diffusers with
each transformer block compiled (``torch.compile``; its compile time stays out of the times);
``--gated-epilogue`` adds, to the forward cases, ours captured with the GEMM engine's gated-residual epilogue
(``ours_strict_graph_gated``: the attention-output and MLP-down products fused with their gated residual, off
by default in the model until measured); ``--grad-sink`` adds, to the training cases, ours captured with a
streamed grad sink as ``train`` runs its micro-batches (``ours_strict_graph_sink``: per-sample LoRA partials
without autograd's sums, the fold into ``.grad`` timed with the step).

Per case and engine: median and spread of CUDA-event times, peak memory, MFU against the measured
790 TFLOP/s BF16 matrix rate, host syncs per forward (``torch.cuda.set_sync_debug_mode``) and CUDA
kernel launches per forward (profiler). Writes ``DIR/model_bench.json``, ``DIR/model_bench.md`` and
``DIR/model_bench.png`` (wall and kernel time per case and engine); ``--replot REPORT.json`` redraws the
figure of a written report, next to it (no GPU needed).
A benchmark, not a test: nothing here asserts. An engine that cannot run a case (e.g. ``strict`` while
an operator has no CUDA kernel) gets its error recorded instead of a time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from ..config.arch import ArchConfig, preset
from ..kernels.grad_sink import SampleGradSink, collect_sample_grads, sample_keys
from ..kernels.runtime import Runtime
from ..model.module_index import trainable_parameters
from ..model.inputs import random_inputs
from ..environment import environment_line, gpu_environment
from ..figures import pyplot, save_png
from .output import replot, write_report
from .timing import cuda_profiler, gpu_gaps

PEAK_TFLOPS = 790.0  # BF16 dense matrix rate measured on the H200 (docs/design.md, anchors)
LORA_TARGETS = (
    "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
)


def forward_flops(arch: ArchConfig, img_tokens: Sequence[int], txt_tokens: Sequence[int]) -> float:
    """Matrix FLOPs of one forward (2·M·N·K per GEMM, 4·L²·d per head for attention), summed over samples."""
    D, F, H, d = arch.hidden_size, arch.mlp_hidden, arch.num_attention_heads, arch.attention_head_dim
    total = 0.0
    for ti, tt in zip(img_tokens, txt_tokens):
        rows = ti + tt
        per_block = 2 * rows * D * (3 * D + D + 2 * F)  # q, k, v, out, mlp up, mlp down
        per_block += 4 * rows * rows * d * H  # QKᵀ and PV
        per_block += 2 * 2 * D * 6 * D  # two modulation GEMMs (one row each)
        total += arch.num_layers * per_block
        total += 2 * ti * arch.in_channels * D + 2 * tt * arch.joint_attention_dim * D + 2 * ti * D * arch.in_channels
    return total


def _timed(fn: Callable[[], Any], reps: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times, host = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)  # until the last launch is queued: the host's share of the call
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "reps": reps,
            "host_ms": statistics.median(host)}


def _count_syncs(fn: Callable[[], Any]) -> int:
    """Host-device synchronisations one call makes (warnings raised by the sync debug mode)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    # "called a synchronizing CUDA operation"; not the notice that the debug mode is a prototype (once per process)
    return sum("called a synchronizing" in str(w.message) for w in caught)


def _kernel_profile(fn: Callable[[], Any], top: int = 0) -> tuple[int, float, list[dict[str, Any]], dict[str, Any]]:
    """(CUDA kernel launches, summed kernel time in ms, the ``top`` kernels by summed time, where the GPU waited
    between them: :func:`~.timing.gpu_gaps`) of one call."""
    from torch.profiler import ProfilerActivity

    with cuda_profiler(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us() / 1e3)
    table = sorted(({"kernel": k[:90], "ms": sum(v), "launches": len(v)} for k, v in by_name.items()),
                   key=lambda r: -r["ms"])[:top]
    gaps = gpu_gaps([(e.time_range.start, e.time_range.elapsed_us(), e.name) for e in kernels], top=5)
    return len(kernels), sum(e.time_range.elapsed_us() for e in kernels) / 1e3, table, gaps


def _inputs(arch: ArchConfig, grid: tuple[int, int], txt_lens: Sequence[int], dtype: torch.dtype,
            device: str = "cuda") -> dict[str, Any]:
    inp = random_inputs(arch, grid, txt_lens, seed=0)
    out = {}
    for k, v in inp.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device)
            out[k] = v.to(dtype) if v.is_floating_point() else v
        else:
            out[k] = v
    return out


def _attach_lora(module: torch.nn.Module, rank: int, seed: int) -> None:
    """Rank-``rank`` LoRA on Flow-GRPO's targets with non-zero B (so the adapter's backward is real), on the
    module's device; only the adapter trains."""
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(LORA_TARGETS), lora_dropout=0.0), module)
    device = next(module.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.requires_grad_("lora_" in name)
            if "lora_" in name:
                p.copy_((0.01 * torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)).to(p.dtype))


def run(args: argparse.Namespace, on_case: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every case for every engine; ``on_case(results so far)`` after each case (partial reports survive a timeout)."""
    from ..model.diffusers_compat import diffusers_twin
    from ..model.init import build_model

    dtype = torch.bfloat16
    arch = preset("qwen-image")
    if args.layers != arch.num_layers:
        import dataclasses

        arch = dataclasses.replace(arch, num_layers=args.layers)
    ours = build_model(arch, seed=0, runtime="off", dtype=dtype, device="cuda")
    theirs = diffusers_twin(ours)
    grid = tuple(args.grid)
    ti = grid[0] * grid[1]
    from ..model.graphs import GraphCache
    from ..model.train_graphs import TrainGraphCache

    graph_cache, train_cache = GraphCache(), TrainGraphCache()
    gated_cache = GraphCache()  # the gated-residual epilogue's graphs: the other path must not replay these
    compiled: dict[int, torch.nn.Module] = {}  # diffusers block index → its compiled wrapper (same parameters)
    cases = {
        "fwd_b1": ([args.txt], False),
        "fwd_b2_cfg": ([args.txt, max(1, args.txt // 2)], False),
        "fwd_bwd_lora": ([args.txt], True),
        "fwd_bwd_lora_b2_cfg": ([args.txt, max(1, args.txt // 2)], True),
    }
    results: dict[str, Any] = {}
    lora_attached = False
    for case, (txt_lens, train) in cases.items():
        if args.cases and case not in args.cases:
            continue
        inp = _inputs(arch, grid, txt_lens, dtype)
        flops = forward_flops(arch, [ti] * len(txt_lens), txt_lens) * (3.0 if train else 1.0)
        engines: dict[str, Callable[[], Any]] = {}

        def diffusers_call() -> torch.Tensor:
            kw = dict(inp, img_shapes=[[(1, grid[0], grid[1])]] * len(txt_lens), return_dict=False)
            return theirs(**kw)[0]

        def ours_call(runtime: str, graphs: bool = False) -> Callable[[], torch.Tensor]:
            def call() -> torch.Tensor:
                ours.set_runtime(runtime)
                ours.graph_cache = graph_cache if graphs else None
                ours.train_graphs = train_cache if graphs else None
                return ours(**inp, return_dict=False)[0]

            return call

        engine_calls = {"diffusers_eager": diffusers_call, **{f"ours_{r}": ours_call(r) for r in args.runtimes}}
        engine_calls.update({f"ours_{r}_graph": ours_call(r, True) for r in args.runtimes if r in ("strict", "auto")})
        if args.gated_epilogue and not train and "strict" in args.runtimes:
            from ..kernels.triton.gemm import autograd as gemm_autograd

            def gated_call() -> torch.Tensor:
                ours.set_runtime("strict")
                ours.graph_cache, ours.train_graphs = gated_cache, None
                gemm_autograd.offer_gate_residual_fusion(True)
                try:
                    return ours(**inp, return_dict=False)[0]
                finally:
                    gemm_autograd.offer_gate_residual_fusion(gemm_autograd.GATE_RESIDUAL_FUSION)

            engine_calls["ours_strict_graph_gated"] = gated_call
        if args.diffusers_compile:
            def compiled_call() -> torch.Tensor:
                with _compiled_blocks(theirs, compiled):
                    return diffusers_call()

            engine_calls["diffusers_compiled"] = compiled_call
        if args.grad_sink and train and "strict" in args.runtimes:
            def sink_call() -> torch.Tensor:  # returns the output; the step below folds after the backward
                ours.set_runtime("strict")
                ours.graph_cache, ours.train_graphs = graph_cache, train_cache
                return ours(**inp, return_dict=False)[0]

            engine_calls["ours_strict_graph_sink"] = sink_call
        for name, call in engine_calls.items():
            if train and name == "ours_strict_graph_sink":
                def sink_step(call: Callable[[], torch.Tensor] = call, n: int = len(txt_lens)) -> None:
                    # as `train` runs a micro-batch: per-sample partials into a streamed sink that takes no autograd
                    # sums (the captured steps share their partial buffers), then the fold into .grad
                    keys = list(range(n))
                    sink = SampleGradSink(keys, autograd_sums=False)
                    with collect_sample_grads(sink), sample_keys(keys):
                        out = call()
                    out.float().square().mean().backward()
                    sink.done(keys)
                    for p in trainable_parameters(ours):
                        folded = sink.fold(p)
                        if folded is not None:
                            p.grad = folded.to(p.dtype)
                engines[name] = sink_step
            elif train:
                def step(call: Callable[[], torch.Tensor] = call) -> None:
                    out = call()
                    out.float().square().mean().backward()
                engines[name] = step
            else:
                def infer(call: Callable[[], torch.Tensor] = call) -> None:
                    with torch.no_grad():
                        call()
                engines[name] = infer
        if train and not lora_attached:
            _attach_lora(ours, args.lora_rank, seed=1)
            _attach_lora(theirs, args.lora_rank, seed=1)
            lora_attached = True
            graph_cache.clear(), train_cache.clear()  # the adapters are new parameters
            ours.enable_gradient_checkpointing(True)
            theirs.enable_gradient_checkpointing()
            theirs.train()
        row: dict[str, Any] = {"txt_lens": txt_lens, "img_tokens": ti, "tflop": flops / 1e12}
        for name, fn in engines.items():
            try:
                torch.cuda.reset_peak_memory_stats()
                t = _timed(fn, args.reps, args.warmup)
                t["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                t["mfu"] = flops / (t["median_ms"] * 1e-3) / (PEAK_TFLOPS * 1e12)
                t["syncs"] = _count_syncs(fn)
                t["launches"], t["kernel_ms"], table, gaps = _kernel_profile(fn, args.kernel_table)
                t["gaps"] = gaps
                if table:
                    t["kernels"] = table
                t["busy"] = t["kernel_ms"] / t["median_ms"]  # GPU busy / wall (the profiled call against the median)
                t["host_us_per_launch"] = t["host_ms"] * 1e3 / max(1, t["launches"])
                # the GPU's idle time spread over the launches: in a GPU-bound replay, the gaps between kernels
                t["idle_us_per_launch"] = max(0.0, t["median_ms"] - t["kernel_ms"]) * 1e3 / max(1, t["launches"])
                row[name] = t
            except Exception as exc:  # an engine that cannot run here: record why and go on
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            finally:
                for p in list(ours.parameters()) + list(theirs.parameters()):
                    p.grad = None
        base = row.get("diffusers_eager", {}).get("median_ms")
        base_compiled = row.get("diffusers_compiled", {}).get("median_ms")
        for name in engines:
            if base and "median_ms" in row[name]:
                row[name]["vs_diffusers"] = row[name]["median_ms"] / base
            if base_compiled and "median_ms" in row[name]:
                row[name]["vs_diffusers_compiled"] = row[name]["median_ms"] / base_compiled
        results[case] = row
        if on_case is not None:
            on_case(results)
    return {"arch_layers": arch.num_layers, "grid": list(grid), "cases": results}


@contextlib.contextmanager
def _compiled_blocks(model: torch.nn.Module, wrappers: dict[int, torch.nn.Module]) -> Iterator[None]:
    """Inside the block, each of ``model``'s transformer blocks is its ``torch.compile`` wrapper (made once, kept
    in ``wrappers``; the wrapper shares the block's parameters and recompiles when an adapter is added)."""
    blocks = model.transformer_blocks
    plain = list(blocks)
    for i, block in enumerate(plain):
        if i not in wrappers:
            wrappers[i] = torch.compile(block)
        blocks[i] = wrappers[i]
    try:
        yield
    finally:
        for i, block in enumerate(plain):
            blocks[i] = block


#: engines in the figure's order, with their labels
_PLOT_ENGINES = (("diffusers_eager", "diffusers eager"), ("diffusers_compiled", "diffusers compiled"),
                 ("ours_strict", "ours, uncaptured"), ("ours_strict_graph", "ours, captured"))


def plot(report: dict[str, Any], path: str | Path) -> bool:
    """A horizontal bar per (case, engine): wall time, with the profiled kernel time drawn inside it (the
    rest of the bar is the GPU waiting). Writes ``path`` (PNG); False when the report holds no timed engine."""
    rows = [(case, label, r["median_ms"], r.get("kernel_ms"))
            for case, row in report["cases"].items()
            for name, label in _PLOT_ENGINES
            if isinstance(row.get(name), dict) and "median_ms" in row[name]
            for r in (row[name],)]
    if not rows:
        return False
    plt = pyplot()

    colors = {label: c for (_, label), c in zip(_PLOT_ENGINES, ("#9e9e9e", "#616161", "#90caf9", "#1565c0"))}
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(rows) + 1.4))
    ys = list(range(len(rows)))[::-1]
    for y, (case, label, wall, kernel) in zip(ys, rows):
        ax.barh(y, wall, color=colors[label], alpha=0.45, height=0.8)
        if kernel is not None:
            ax.barh(y, min(kernel, wall), color=colors[label], height=0.8)
        ax.text(wall, y, f" {wall:.0f} ms", va="center", fontsize=8)
    ax.set_yticks(ys, [f"{case} · {label}" for case, label, _, _ in rows], fontsize=8)
    ax.set_xlabel("ms per call (dark: kernel time of one profiled call; light: the rest of the wall time)")
    env = report.get("environment", {})
    ax.set_title(f"{report.get('arch_layers', '?')} blocks, grid {report.get('grid')}, {env.get('gpu', '')} · "
                 f"commit {str(env.get('commit', '?'))[:7]}", fontsize=9)
    ax.set_xlim(0, max(w for _, _, w, _ in rows) * 1.15)
    save_png(fig, path)
    return True


def environment() -> dict[str, Any]:
    return gpu_environment()


def _long_gaps(r: dict[str, Any]) -> str:
    classes = (r.get("gaps") or {}).get("classes")
    return f"{classes[-1]['idle_ms']:.1f} ({classes[-1]['gaps']})" if classes else "—"


def render(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# Whole-model benchmark: ours vs diffusers eager ({report['arch_layers']} blocks, grid {report['grid']})",
        "",
        environment_line(env),
        "",
        f"Identical BF16 weights (one storage). Times are medians of CUDA-event intervals; MFU against {PEAK_TFLOPS:.0f} TFLOP/s.",
        "",
        "Host ms: the median time until a call returns with its last launch queued; host µs / launch divides it by the "
        "profiled call's kernel launches (a host-bound engine's wall time is its host time). Idle µs / launch: wall minus "
        "kernel time over the launches. Long-gap idle: the profiled call's idle time in gaps of 100 µs or more between kernels "
        "(the host blocked or queued late, not launch gaps).",
        "",
        "| case | engine | median ms | × diffusers | × diffusers compiled | MFU | kernel ms | busy / wall | idle µs / launch "
        "| long-gap idle ms | host ms | host µs / launch | peak GiB | syncs | launches |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, row in report["cases"].items():
        for name, r in row.items():
            if not isinstance(r, dict):
                continue
            if "error" in r:
                lines.append(f"| {case} | {name} | error: {r['error'][:120]} | | | | | | | | | | | | |")
                continue
            lines.append(
                f"| {case} | {name} | {r['median_ms']:.1f} | {r.get('vs_diffusers', float('nan')):.2f} | "
                f"{r.get('vs_diffusers_compiled', float('nan')):.2f} | {r['mfu']:.2f} | {r.get('kernel_ms', float('nan')):.1f} | "
                f"{r.get('busy', float('nan')):.2f} | {r.get('idle_us_per_launch', float('nan')):.1f} | {_long_gaps(r)} | "
                f"{r.get('host_ms', float('nan')):.1f} | "
                f"{r.get('host_us_per_launch', float('nan')):.1f} | {r['peak_gib']:.1f} | {r['syncs']} | {r['launches']} |"
            )
    for case, row in report["cases"].items():
        for name, r in row.items():
            if isinstance(r, dict) and r.get("kernels"):
                lines += ["", f"### {case} · {name}: kernels by summed time (one call)", "",
                          "| kernel | ms | launches |", "|---|---|---|"]
                lines += [f"| `{k['kernel']}` | {k['ms']:.1f} | {k['launches']} |" for k in r["kernels"]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmdit_strict.bench.model", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="experiments/local", help="output folder")
    p.add_argument("--layers", type=int, default=60, help="transformer blocks (60 = Qwen-Image)")
    p.add_argument("--grid", type=int, nargs=2, default=(64, 64), help="latent grid in tokens (64 64 = 1024² images)")
    p.add_argument("--txt", type=int, default=128, help="valid prompt tokens of the first sample")
    p.add_argument("--runtimes", nargs="+", default=["strict", "off"], choices=[r.value for r in Runtime])
    p.add_argument("--lora-rank", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--kernel-table", type=int, default=0, metavar="N",
                   help="record each engine's N most expensive kernels of one call (profiler)")
    p.add_argument("--cases", nargs="+", default=None, help="run only these cases (default: all)")
    p.add_argument("--gated-epilogue", action="store_true",
                   help="forward cases: also time ours captured with the GEMM's gated-residual epilogue "
                        "(ours_strict_graph_gated; kernels/triton/gemm GATE_RESIDUAL_FUSION, off by default)")
    p.add_argument("--grad-sink", action="store_true",
                   help="also time ours captured with the grad sink as train runs it (ours_strict_graph_sink)")
    p.add_argument("--diffusers-compile", action="store_true",
                   help="also time diffusers with each transformer block compiled (torch.compile; minutes of compile)")
    p.add_argument("--replot", default=None, metavar="REPORT.json",
                   help="only redraw the figure of a written report (model_bench.png beside it); no GPU needed")
    args = p.parse_args(argv)
    if args.replot:
        return replot(args.replot, plot, "bench.model", "no timed engine to draw")
    if not torch.cuda.is_available():
        raise SystemExit("bench.model needs a CUDA GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()

    def partial(results: dict[str, Any]) -> None:
        (out / "model_bench.partial.json").write_text(json.dumps({"environment": env, "cases": results}, indent=2))
        print(f"done: {', '.join(results)}", flush=True)

    report = run(args, on_case=partial)
    report["environment"] = env
    print(write_report(out, "model_bench", report, render))
    plot(report, out / "model_bench.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Qualify the model-parallel layouts on the machine at hand: one rank's bytes vs every layout's.

Run under torchrun (every rank computes the one-rank reference itself, then the same batch under each
layout whose size divides the world)::

    torchrun --standalone --nproc-per-node 4 -m mmdit_strict.trajectories.layout_check --arch qwen-image --layers 4 \\
        --size 1024 --out OUT

For each layout it compares, as raw bytes, the CFG velocity (autograd on and off) and the LoRA gradients:
the ranks' own sums where every rank ran both CFG branches, and the model group's fold of its per-sample
partials (``distributed.fold``) always. Rank 0 writes ``parallel_check.json`` and ``parallel_check.md``
(with the environment line and each layout's wall times). Exit 0 when every check holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

LAYOUTS = {"sp2": {"sp": 2}, "sp4": {"sp": 4}, "cfg2": {"cfg": 2}, "sp2xcfg2": {"sp": 2, "cfg": 2}, "tp2": {"tp": 2},
           "tp4": {"tp": 4}, "tp2xsp2": {"tp": 2, "sp": 2}, "tp2xcfg2": {"tp": 2, "cfg": 2},
           "tp2xsp2xcfg2": {"tp": 2, "sp": 2, "cfg": 2}, "sp2ag": {"sp": 2, "attention": "allgather"},
           "tp2xsp2ag": {"tp": 2, "sp": 2, "attention": "allgather"}}
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_v_proj", "img_mlp.net.0.proj", "img_mlp.net.2",
                "txt_mlp.net.2", "img_mod.1"]


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model(args: argparse.Namespace, device: str) -> Any:
    from ..config.arch import preset
    from ..config.schema import LoraConfig
    from ..dtypes import BY_CONFIG_NAME as DTYPES
    from ..model.init import build_model
    from .setup import attach_lora

    arch = preset(args.arch)
    if args.layers:
        arch = dataclasses.replace(arch, num_layers=args.layers)
    model = build_model(arch, seed=0, runtime="strict", dtype=DTYPES[args.dtype], device=device)
    attach_lora(model, LoraConfig(rank=args.lora_rank, alpha=float(args.lora_rank), targets=LORA_TARGETS, init="random"))
    model.requires_grad_(False)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.requires_grad_(True)
    model.gradient_checkpointing = True
    return model


def _batch(model: Any, args: argparse.Namespace, grid: tuple[int, int]) -> tuple[torch.Tensor, list, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    arch = model.config
    lens = [args.txt_tokens - 7 * i for i in range(args.batch)]
    x = torch.randn(args.batch, grid[0] * grid[1], arch.in_channels, generator=g)
    cond = [torch.randn(n, arch.joint_attention_dim, generator=g) for n in lens]
    neg = torch.randn(5, arch.joint_attention_dim, generator=g)
    dev, dt = model.device, model.dtype
    return x.to(dev, dt), [c.to(dev, dt) for c in cond], neg.to(dev, dt)


def _one(model: Any, batch: tuple, grid: tuple[int, int], weight: torch.Tensor, pad_to: int) -> dict[str, Any]:
    from ..distributed.fold import rank_partials
    from ..kernels.grad_sink import SampleGradSink, collect_sample_grads
    from .engine import velocity

    x, cond, neg = batch
    sigmas = [0.9 - 0.3 * i for i in range(x.shape[0])]
    dev = x.device
    with torch.no_grad():
        _sync(dev)
        t0 = time.perf_counter()
        v0 = velocity(model, x, cond, neg, sigmas, grid, cfg_scale=4.0, cfg_layout="batched", pad_to=pad_to)
        _sync(dev)
        t_fwd = time.perf_counter() - t0
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    sink = SampleGradSink()
    _sync(dev)
    t0 = time.perf_counter()
    with collect_sample_grads(sink):
        v = velocity(model, x, cond, neg, sigmas, grid, cfg_scale=4.0, cfg_layout="sequential", pad_to=pad_to)
        (v * weight).sum().backward()
    _sync(dev)
    t_train = time.perf_counter() - t0
    return {"v": _sha(v), "v_nograd": _sha(v0), "grads": {n: _sha(p.grad) for n, p in trainable if p.grad is not None},
            "share": rank_partials(trainable, sink), "forward_s": t_fwd, "fwd_bwd_s": t_train}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmdit_strict.trajectories.layout_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="tiny", help="architecture preset (tiny | qwen-image)")
    ap.add_argument("--layers", type=int, default=0, help="keep only this many blocks (0: the preset's)")
    ap.add_argument("--size", type=int, default=0, help="image side in pixels (16 per latent token side); 0: a 3x5 grid")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--txt-tokens", type=int, default=24, help="longest prompt; the others are 7 tokens shorter each")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--dtype", default="", help="float32 | bfloat16 (default: bfloat16 on CUDA, float32 on the CPU)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list from {sorted(LAYOUTS)}")
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"),
                    help="gloo: host-staged (CPU ranks, or ranks sharing one GPU); nccl: one GPU per rank")
    ap.add_argument("--out", required=True, help="folder for parallel_check.json / .md (rank 0)")
    args = ap.parse_args(argv)
    from .. import distributed, parallel
    from ..distributed.fold import fold_ranks
    from ..environment import environment_line, run_environment

    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    unknown = [n for n in args.layouts.split(",") if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layouts {unknown}; choose from {sorted(LAYOUTS)}")
    if not distributed.launched():
        ap.error("run it under torchrun (--nproc-per-node 2 or 4)")
    with distributed.session(600.0, args.backend, device) as s:
        dev = f"cuda:{torch.cuda.current_device()}" if device == "cuda" else "cpu"
        model = _model(args, dev)
        grid = (args.size // 16, args.size // 16) if args.size else (3, 5)
        batch = _batch(model, args, grid)
        weight = torch.randn(batch[0].shape, generator=torch.Generator().manual_seed(5)).to(dev, torch.float32)
        pad_to = args.txt_tokens + 3
        _one(model, batch, grid, weight, pad_to)  # warm-up: kernel compilation stays out of the timings
        ref = _one(model, batch, grid, weight, pad_to)
        ref_fold = {n: _sha(f) for n in ref["grads"] if (f := fold_ranks(n, [ref["share"]])) is not None}
        rows = []
        for name in args.layouts.split(","):
            lay = parallel.ModelLayout(**LAYOUTS[name])
            try:
                lay.check(s.world_size, model.config.num_attention_heads)
            except ValueError:
                continue  # the layout does not fit this world or head count
            with parallel.model_parallel(lay) as mp:
                _one(model, batch, grid, weight, pad_to)  # warm-up: the layout's compiles and shard probes stay out of the times
                mp.stats.update(calls=0, bytes=0)
                got = _one(model, batch, grid, weight, pad_to)
            both = lay.cfg == 1
            group = lay.group_ranks(s.world_size, "model")[lay.coords(s.rank)["dp"]]
            shares = distributed.all_gather(f"{name}: partials", got["share"] if mp.sends_partials else None)
            folds = {n: _sha(f) for n in ref_fold if (f := fold_ranks(n, [shares[q] for q in group if shares[q] is not None]))
                     is not None}
            rows.append({"layout": name, "rank": s.rank, "v": got["v"] == ref["v"], "v_nograd": got["v_nograd"] == ref["v_nograd"],
                         "grads": (got["grads"] == ref["grads"]) if both else None, "group_fold": folds == ref_fold,
                         "params": len(ref_fold), "forward_s": got["forward_s"], "fwd_bwd_s": got["fwd_bwd_s"],
                         "exchanges": mp.stats["calls"], "exchanged_bytes": mp.stats["bytes"]})
        everyone = distributed.all_gather("results", rows)
    if s.rank != 0:
        return 0
    flat = [r for part in everyone for r in part]
    ok = all(r["v"] and r["v_nograd"] and r["grads"] is not False and r["group_fold"] for r in flat)
    env = run_environment(device)
    report = {"environment": env, "arch": args.arch, "layers": model.config.num_layers, "grid": list(grid),
              "batch": args.batch, "dtype": args.dtype, "world": s.world_size, "lora_rank": args.lora_rank,
              "one_rank": {"forward_s": ref["forward_s"], "fwd_bwd_s": ref["fwd_bwd_s"]}, "rows": flat, "pass": ok}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "parallel_check.json").write_text(json.dumps(report, indent=2) + "\n")
    mark = {True: "equal", False: "**differs**", None: "—"}
    lines = [f"# Model-parallel layouts vs one rank: {'all byte-equal' if ok else 'DIFFERENCES'}", "",
             environment_line(env, f"world {s.world_size} ({args.backend})"), "",
             f"{args.arch}, {model.config.num_layers} blocks, {grid[0]}x{grid[1]} latent grid, batch {args.batch} (CFG 4.0), "
             f"{args.dtype}, LoRA r={args.lora_rank} on {len(ref_fold)} tensors. One rank: forward {ref['forward_s']:.3f} s, "
             f"forward+backward {ref['fwd_bwd_s']:.3f} s.", "",
             "| layout | rank | v (autograd) | v (no grad) | LoRA grads (own sums) | LoRA grads (group fold) | forward s | fwd+bwd s | exchanges | MB moved |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in flat:
        lines.append(f"| {r['layout']} | {r['rank']} | {mark[r['v']]} | {mark[r['v_nograd']]} | {mark[r['grads']]} | "
                     f"{mark[r['group_fold']]} | {r['forward_s']:.3f} | {r['fwd_bwd_s']:.3f} | {r['exchanges']} | "
                     f"{r['exchanged_bytes'] / 2**20:.1f} |")
    lines += ["", "Own sums: a rank's autograd gradient, comparable where each rank ran both CFG branches. Group fold: the "
              "model group's per-sample partials folded over the sample keys (the gradient training uses)."]
    (out / "parallel_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

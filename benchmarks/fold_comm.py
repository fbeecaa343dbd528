"""What the cross-rank LoRA-gradient fold costs at Qwen-Image size, against one all-reduce of the same gradient.

Two parts, one JSON + markdown report (``OUT/fold_comm.json``, ``OUT/fold_comm.md``):

1. **fold** (one process, ``--device``): one optimizer update's ``K`` per-key partials of every LoRA
   tensor (rank ``--rank`` on Flow-GRPO's 12 targets of ``--blocks`` blocks) folded by the streamed
   sink's tree, against the left chain it replaced (one accumulator): time and peak device memory.
2. **exchange** (``W`` processes on one host, gloo, tensors staged through host memory as the training
   loop does): :func:`~mmdit_strict.distributed.fold.merge_update` of each rank's nodes for its key
   range, against ``dist.all_reduce`` (gloo) of the same gradient as one flat FP32 tensor, moved from and
   back to the device like the merge's tensors. Time per update and tensor bytes each rank sent and got.

The 8-rank line is computed, not measured: per rank bytes from the node counts of 8 ranges of the
update's ``K`` keys, time from the measured host-staged throughput.

    python -m benchmarks.fold_comm --device cuda --ranks 2 4 --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

TARGETS = {  # Flow-GRPO's LoRA targets of one block: (in, out) in units of (hidden, mlp hidden)
    "to_q": ("h", "h"), "to_k": ("h", "h"), "to_v": ("h", "h"), "to_out.0": ("h", "h"),
    "add_q_proj": ("h", "h"), "add_k_proj": ("h", "h"), "add_v_proj": ("h", "h"), "to_add_out": ("h", "h"),
    "img_mlp.net.0.proj": ("h", "m"), "img_mlp.net.2": ("m", "h"), "txt_mlp.net.0.proj": ("h", "m"), "txt_mlp.net.2": ("m", "h"),
}


def lora_shapes(blocks: int, rank: int) -> dict[str, tuple[int, ...]]:
    """Every LoRA tensor of the qwen-image preset's first ``blocks`` blocks: ``lora_A`` (r, in), ``lora_B`` (out, r)."""
    from mmdit_strict.config.arch import preset

    arch = preset("qwen-image")
    size = {"h": arch.hidden_size, "m": arch.mlp_hidden}
    out: dict[str, tuple[int, ...]] = {}
    for b in range(blocks):
        for name, (i, o) in TARGETS.items():
            out[f"blocks.{b}.{name}.lora_A"] = (rank, size[i])
            out[f"blocks.{b}.{name}.lora_B"] = (size[o], rank)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def part_fold(shapes: dict[str, tuple[int, ...]], keys: int, device: torch.device) -> dict:
    """Tree (streamed sink) vs left chain over ``keys`` fresh partials per tensor, partials handed over as the backward does."""
    from mmdit_strict.kernels.grad_sink import SampleGradSink

    params = {n: torch.empty(0, device=device) for n in shapes}
    leaf = {n: torch.full(s, 1.0, device=device) for n, s in shapes.items()}
    res = {}
    for kind in ("chain", "tree"):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        _sync(device)
        t0 = time.perf_counter()
        if kind == "tree":
            sink = SampleGradSink(list(range(keys)))
            for k in range(keys):
                for n in shapes:
                    sink.add(params[n], [k], [leaf[n].clone()], transfer=True)
                sink.done([k])
            out = {n: sink.fold(params[n]) for n in shapes}
        else:
            out = {}
            for k in range(keys):
                for n in shapes:
                    part = leaf[n].clone()
                    out[n] = part if n not in out else out[n].add_(part)
        _sync(device)
        dt = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else None
        res[kind] = {"seconds": dt, "peak_bytes_above_inputs": peak}
        del out
    res["tree_over_chain_time"] = res["tree"]["seconds"] / res["chain"]["seconds"]
    return res


def _rank(rank: int, world: int, port: int, shapes: dict, keys: int, device_kind: str, repeat: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch.distributed as dist

    from mmdit_strict import distributed
    from mmdit_strict.distributed.fold import merge_update
    from mmdit_strict.distributed.layout import block
    from mmdit_strict.kernels.grad_sink import SampleGradSink

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
    span = block(keys, world, rank)
    names = list(shapes)
    numel = sum(torch.Size(s).numel() for s in shapes.values())
    times, sent, got, ar_times = [], [], [], []
    with distributed.session(3600.0, "gloo", device_kind) as sess:
        for _ in range(repeat):
            sink = SampleGradSink(list(span), first_index=span.start)
            anchors = {n: torch.empty(0) for n in names}
            for k in span:
                for n, s in shapes.items():
                    sink.add(anchors[n], [k], [torch.full(s, 1.0 + k, device=device)], transfer=True)
                sink.done([k])
            nodes = {}
            for n in names:
                got_nodes = sink.nodes(anchors[n]) if len(span) else None
                nodes[n] = got_nodes or []
            dist.barrier()
            before = sess.traffic.snapshot()
            t0 = time.perf_counter()
            merged = merge_update(names, nodes, span.start, "bench")
            for n in names:
                merged[n] = merged[n].to(device)
            _sync(device)
            moved = sess.traffic.since(before)
            times.append(time.perf_counter() - t0)
            sent.append(moved.bytes_out)
            got.append(moved.bytes_in)
            del merged, nodes, sink
            flat = torch.full((numel,), 1.0, device=device)
            dist.barrier()
            t0 = time.perf_counter()
            host = flat.cpu()
            dist.all_reduce(host)
            flat.copy_(host)
            _sync(device)
            ar_times.append(time.perf_counter() - t0)
            del flat, host
    torch.save({"merge_s": times, "bytes_out": sent, "bytes_in": got, "allreduce_s": ar_times,
                "keys": [span.start, span.stop]}, Path(out) / f"rank{rank}.pt")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def part_exchange(shapes: dict, keys: int, world: int, device: str, repeat: int, scratch: Path) -> dict:
    scratch.mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank, args=(world, _port(), shapes, keys, device, repeat, str(scratch)), nprocs=world, join=True)
    ranks = [torch.load(scratch / f"rank{r}.pt") for r in range(world)]
    best = min(range(repeat), key=lambda i: max(r["merge_s"][i] for r in ranks))
    return {
        "world": world,
        "merge_s": max(r["merge_s"][best] for r in ranks),
        "allreduce_s": min(max(r["allreduce_s"][i] for r in ranks) for i in range(repeat)),
        "per_rank": [{"keys": r["keys"], "bytes_out": r["bytes_out"][best], "bytes_in": r["bytes_in"][best]} for r in ranks],
    }


def nodes_per_range(keys: int, world: int) -> list[int]:
    """How many tree nodes each of ``world`` contiguous ranges of ``keys`` leaves reduces to."""
    from mmdit_strict.distributed.layout import block
    from mmdit_strict.kernels.fold_tree import PairwiseFold

    counts = []
    for r in range(world):
        span = block(keys, world, r)
        f = PairwiseFold(span.start)
        for _ in span:
            f.leaf(None)
        counts.append(len(f.nodes))
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--blocks", type=int, default=60, help="blocks whose LoRA tensors are folded (60: the whole model)")
    p.add_argument("--rank", type=int, default=64, help="LoRA rank")
    p.add_argument("--keys", type=int, default=32, help="gradient keys per update (grpo_qwen_image: 16 pairs x 2 CFG branches)")
    p.add_argument("--ranks", type=int, nargs="*", default=[2, 4], help="world sizes of the exchange part")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    from mmdit_strict.environment import environment_line, run_environment

    shapes = lora_shapes(a.blocks, a.rank)
    grad_bytes = sum(torch.Size(s).numel() for s in shapes.values()) * 4
    device = torch.device(a.device)
    report: dict = {"env": run_environment(a.device), "lora_rank": a.rank, "blocks": a.blocks, "keys_per_update": a.keys,
                    "tensors": len(shapes), "gradient_bytes": grad_bytes, "device": str(device)}
    print(f"LoRA gradient: {len(shapes)} tensors, {grad_bytes / 1e9:.3f} GB FP32; {a.keys} keys per update", flush=True)
    report["fold"] = part_fold(shapes, a.keys, device)
    print(json.dumps(report["fold"]), flush=True)
    report["exchange"] = []
    for w in a.ranks:
        r = part_exchange(shapes, a.keys, w, a.device, a.repeat, a.out / f"scratch_w{w}")
        r["merge_over_allreduce"] = r["merge_s"] / r["allreduce_s"]
        r["ring_allreduce_bytes_per_rank"] = 2 * (w - 1) / w * grad_bytes * 2  # sent + received
        report["exchange"].append(r)
        print(json.dumps(r), flush=True)
    # 8 ranks, estimated: bytes from the node counts, time from the measured host-staged merge throughput
    n8 = nodes_per_range(a.keys, 8)
    last = report["exchange"][-1] if report["exchange"] else None
    est = {"nodes_per_rank": n8, "max_bytes_per_rank": (max(n8) + 1) * grad_bytes,
           "ring_allreduce_bytes_per_rank": 2 * 7 / 8 * grad_bytes * 2}
    if last is not None:
        moved = max(x["bytes_out"] + x["bytes_in"] for x in last["per_rank"])
        est["throughput_bytes_per_s"] = moved / last["merge_s"]
        est["merge_s_estimate"] = (1 + (8 - 1).bit_length()) * grad_bytes / (moved / last["merge_s"]) if moved else None
    report["estimate_8_ranks"] = est
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "fold_comm.json").write_text(json.dumps(report, indent=2, default=str))
    lines = ["# Cross-rank LoRA-gradient fold at Qwen-Image size", "", environment_line(report["env"]), "",
             f"LoRA r={a.rank} on Flow-GRPO's 12 targets x {a.blocks} blocks: {len(shapes)} tensors, "
             f"{grad_bytes / 1e9:.3f} GB FP32; {a.keys} keys per update.", "",
             "| fold (one process) | time s | peak extra device memory GB |", "|---|---|---|"]
    for k in ("chain", "tree"):
        f = report["fold"][k]
        pk = f["peak_bytes_above_inputs"]
        lines.append(f"| {k} | {f['seconds']:.3f} | {'-' if pk is None else f'{pk / 1e9:.2f}'} |")
    lines += ["", "| ranks | merge s | all-reduce s | merge/all-reduce | max bytes per rank (out+in) GB | ring all-reduce GB |",
              "|---|---|---|---|---|---|"]
    for r in report["exchange"]:
        mx = max(x["bytes_out"] + x["bytes_in"] for x in r["per_rank"])
        lines.append(f"| {r['world']} | {r['merge_s']:.2f} | {r['allreduce_s']:.2f} | {r['merge_over_allreduce']:.2f} | "
                     f"{mx / 1e9:.2f} | {r['ring_allreduce_bytes_per_rank'] / 1e9:.2f} |")
    lines += ["", f"8 ranks (estimate): nodes per rank {n8}; at most {est['max_bytes_per_rank'] / 1e9:.2f} GB per rank "
              f"vs {est['ring_allreduce_bytes_per_rank'] / 1e9:.2f} GB for a ring all-reduce"
              + (f"; about {est['merge_s_estimate']:.1f} s per update at the measured host-staged throughput"
                 if est.get("merge_s_estimate") else "") + "."]
    (a.out / "fold_comm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

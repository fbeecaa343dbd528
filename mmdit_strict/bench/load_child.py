"""One measured step of the load benchmark, in a process of its own (so host memory figures are its own).

    python -m mmdit_strict.bench.load_child load --engine ours|diffusers --checkpoint DIR --device D --dtype DT
    python -m mmdit_strict.bench.load_child build --folder DIR --preset P --layers N --shards S --device D

``load`` imports everything and starts the device first, then times one load of the transformer onto
``device`` (the device synchronised before the clock stops) under :class:`PeakHostMemory`, then hashes the
loaded weights (``state_dict_hash``, after the clock). ``build`` writes a random checkpoint
(``load_checkpoint.write_random_checkpoint``). Each prints one line ``RESULT {json}`` last.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from typing import Any, Callable, Sequence

import torch

from ..config.arch import preset
from ..model import MMDiT, state_dict_hash
from .host_memory import PeakHostMemory
from .load_checkpoint import write_random_checkpoint

ENGINES = ("diffusers", "ours")


def _loader(engine: str, path: str, device: torch.device, dtype: torch.dtype) -> Callable[[], torch.nn.Module]:
    if engine == "ours":
        return lambda: MMDiT.from_pretrained(path, torch_dtype=dtype, device=device)
    from diffusers import QwenImageTransformer2DModel
    from diffusers.utils import logging as dlogging

    dlogging.disable_progress_bar()
    return lambda: QwenImageTransformer2DModel.from_pretrained(path, torch_dtype=dtype).to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_load(engine: str, path: str, device: torch.device, dtype: torch.dtype, digest: bool = True) -> dict[str, Any]:
    """Seconds, host memory growth and weight hash of one load of ``path`` by ``engine`` onto ``device``."""
    load = _loader(engine, path, device, dtype)
    if device.type == "cuda":
        torch.empty(1, device=device)  # the CUDA context exists before the clock starts
    _sync(device)
    gc.collect()
    with PeakHostMemory() as peak:
        start = time.perf_counter()
        model = load()
        _sync(device)
        seconds = time.perf_counter() - start
    out: dict[str, Any] = {
        "engine": engine, "seconds": seconds, "rss_growth": peak.rss, "anon_growth": peak.anon, "memory_method": peak.method,
        "params": sum(p.numel() for p in model.parameters()), "param_device": str(next(model.parameters()).device),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "host_weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cpu"),
    }
    if digest:
        out["state_sha256"] = state_dict_hash(model.state_dict())
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmdit_strict.bench.load_child", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    ld = sub.add_parser("load")
    ld.add_argument("--engine", choices=ENGINES, required=True)
    ld.add_argument("--checkpoint", required=True)
    ld.add_argument("--device", default="cpu")
    ld.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ld.add_argument("--no-hash", action="store_true")
    bd = sub.add_parser("build")
    bd.add_argument("--folder", required=True)
    bd.add_argument("--preset", default="qwen-image")
    bd.add_argument("--layers", type=int, default=None)
    bd.add_argument("--shards", type=int, default=9)
    bd.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if args.what == "load":
        result = time_load(args.engine, args.checkpoint, torch.device(args.device), getattr(torch, args.dtype), not args.no_hash)
    else:
        arch = preset(args.preset)
        if args.layers is not None:
            arch = dataclasses.replace(arch, num_layers=args.layers)
        start = time.perf_counter()
        write_random_checkpoint(arch, args.folder, shards=args.shards, device=args.device)
        result = {"folder": args.folder, "seconds": time.perf_counter() - start}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Probe: does a finished ``torch.profiler`` session slow the launches after it?

Kineto leaves CUPTI subscribed after a profiling session unless ``TEARDOWN_CUPTI=1``; its callbacks then run on
every later driver call of the process. The benches time several engines in one process and profile each after
timing it, so every engine timed after the first profiled one would carry that cost. This times the uncaptured
strict forward of the Qwen-Image architecture cut to 8 blocks (1024², 128 prompt tokens, B = 1; median of 7
calls): before any profiler, after a session with ``TEARDOWN_CUPTI=1``, then after one with ``TEARDOWN_CUPTI=0``.
At 4254df6 on the H200 (``experiments/model/4254df6_uncaptured_fwd``): 23.77, 23.11 and 27.36 ms. Since 4254df6
the benches' profiler sessions tear CUPTI down (``bench/timing.cuda_profiler``).

GPU only:  python -m benchmarks.cupti_teardown_probe OUT_DIR
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

import torch

from mmdit_strict.bench.model import _inputs
from mmdit_strict.config.arch import preset
from mmdit_strict.model.init import build_model


def main(out_dir: str) -> dict[str, float]:
    arch = dataclasses.replace(preset("qwen-image"), num_layers=8)
    model = build_model(arch, seed=0, runtime="strict", dtype=torch.bfloat16, device="cuda")
    inp = _inputs(arch, (64, 64), [128], torch.bfloat16, "cuda")

    def forward() -> None:
        with torch.no_grad():
            model(**inp, return_dict=False)

    def wall_ms(n: int = 7) -> float:
        times = []
        for _ in range(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            forward()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    def profiled() -> None:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]):
            forward()
            torch.cuda.synchronize()

    for _ in range(3):
        forward()
    out = {"before any profiler": wall_ms()}
    os.environ["TEARDOWN_CUPTI"] = "1"
    profiled()
    out["after a session with TEARDOWN_CUPTI=1"] = wall_ms()
    os.environ["TEARDOWN_CUPTI"] = "0"
    profiled()
    out["after a session with TEARDOWN_CUPTI=0"] = wall_ms()
    for k, v in out.items():
        print(f"{k:45s} {v:8.2f} ms", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "cupti_check.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "experiments/local")

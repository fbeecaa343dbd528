"""Probe: host µs per call of one strict GEMM launch, layer by layer, against cuBLAS's.

A (128 × 3072) · (3072 × 3072) BF16 product with bias: small enough that the GPU never holds the host back, so
each loop of 3000 calls measures the host's time per call (``perf_counter`` around the loop, synchronised
after). Layers, outermost first: the public ``gemm`` (autograd function, checks), ``gemm_fwd``, the engine's
``_main`` (allocation, plan, descriptors, launch), Triton's ``kernel[grid](...)`` and the bound launch with
prebuilt arguments, Triton's binder alone and the compiled kernel's launcher alone; and the pieces ``_main``
used to pay per call (input checks, the TMA decision, a tensor descriptor, the specialization tuple, two
``torch.empty``). ``torch.mm`` and ``F.linear`` are the PyTorch reference.

Ran as an uncommitted script at 9b47798 and d962d98 on the H200 (figures in
``experiments/model/4254df6_uncaptured_fwd/README.md``); this is that script with a line for a helper removed
since (the generic argument key of 9b47798).

GPU only:  python -m benchmarks.launch_cost_probe OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
from triton.runtime.driver import driver
from triton.tools.tensor_descriptor import TensorDescriptor

from mmdit_strict.bench import timing
from mmdit_strict.kernels.triton import configs as C
from mmdit_strict.kernels.triton import gemm as G
from mmdit_strict.kernels.triton.bound import bound
from mmdit_strict.kernels.triton.gemm import kernels as K
from mmdit_strict.kernels.triton.gemm import launch as L

CALLS = 3000


def host_us(fn: Callable[[], Any], n: int = CALLS) -> float:
    return timing.host_us(fn, n, warmup=50)


def main(out_dir: str) -> dict[str, float]:
    dt, m, k, n = torch.bfloat16, 128, 3072, 3072
    x = torch.randn(m, k, device="cuda", dtype=dt)
    w = torch.randn(n, k, device="cuda", dtype=dt)
    bias = torch.randn(n, device="cuda", dtype=dt)
    cfg = C.fwd_config(n, k, dt)
    b = L.Operand(w, (1, k), nk=True)
    res: dict[str, float] = {}

    def row(name: str, fn: Callable[[], Any]) -> None:
        res[name] = round(host_us(fn), 2)
        print(f"{name:45s} {res[name]:8.2f} µs", flush=True)

    row("torch.mm", lambda: torch.mm(x, w.t()))
    row("F.linear with bias", lambda: F.linear(x, w, bias))
    row("torch.empty x2", lambda: (torch.empty((m, n), dtype=dt, device="cuda"), torch.empty((m, n), dtype=dt, device="cuda")))
    row("gemm (public, no grad)", lambda: G.gemm(x, w, bias, seqlens=(m,)))
    row("gemm_fwd", lambda: G.gemm_fwd(x, w, bias))
    row("_main", lambda: L._main(x, b, n, cfg, bias=bias))
    row("check_inputs", lambda: L.check_inputs(x, w, bias, (m,), "none", "none", None))
    row("_use_tma", lambda: L._use_tma(cfg, x, b, 64, 128, 0))
    row("TensorDescriptor", lambda: TensorDescriptor(x, [m, k], [k, 1], [128, 64]))
    # the launch _main makes for this call, rebuilt with its plan
    y = torch.empty((m, n), dtype=dt, device="cuda")
    L._main(x, b, n, cfg, bias=bias)
    plan = next(p for key, p in L._PLANS.items() if key[4:7] == (m, k, n) and key[11] == cfg)
    spec = plan.kw["CFG"]
    row("FwdSpec", lambda: spec._replace())
    a_arg, b_arg, o_arg = x, w, y
    if plan.use_tma:
        a_arg = TensorDescriptor(x, [m, k], [k, 1], [cfg.BLOCK_M, plan.bk])
        b_arg = TensorDescriptor(w, [n, k], [k, 1], [plan.bn, plan.bk])
        if plan.tma_store:
            o_arg = TensorDescriptor(y, [m, n], [n, 1], [cfg.BLOCK_M, plan.bn // plan.split])
    args = (a_arg, b_arg, o_arg, (k, 1, k, n), (y, 0, y, 0, 0, 0, 1.0), (bias, y, 0, y, y), m, n, k, None)
    row("Triton kernel[grid](...), prebuilt args", lambda: K._gemm_fwd_kernel[plan.grid](*args, **plan.kw))
    bk = bound(K._gemm_fwd_kernel)
    row("bound kernel[grid](...), prebuilt args", lambda: bk[plan.grid](*args, **plan.kw))
    device = torch.cuda.current_device()
    binder = K._gemm_fwd_kernel.device_caches[device][4]
    row("Triton's binder alone", lambda: binder(*args, **plan.kw))
    compiled = K._gemm_fwd_kernel[plan.grid](*args, **plan.kw)
    values = tuple(binder(*args, **plan.kw)[0].values())
    stream = driver.active.get_current_stream(device)
    row("compiled kernel's launcher alone",
        lambda: compiled.run(plan.grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *values))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "launch_cost.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "experiments/local")

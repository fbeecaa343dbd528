"""Probe: the device's copy bandwidth by size and method (``copy_`` = the driver's memcpy, ``sm copy`` =
:func:`mmdit_strict.bench.bandwidth.sm_copy`), warm (one buffer pair replayed) and cold (rotating buffer pairs,
256 MiB or more in all, so that no replay finds its input in L2), and the LayerNorm-modulation forward the same two
ways. GPU only:  python -m benchmarks.copy_probe OUT.json
"""

from __future__ import annotations

import json
import sys

import torch

from mmdit_strict.bench.bandwidth import sm_copy
from mmdit_strict.bench.timing import graph_ms


def sets_for(nbytes: int, floor: int = 256 << 20) -> int:
    """Buffer sets for a cold measurement: together at least ``floor`` bytes (the H200's L2 is 50 MB)."""
    return max(1, -(-floor // nbytes))


def measure(fn_of_set, make_set, nbytes: int, cold: bool) -> float | None:
    k = sets_for(nbytes) if cold else 1
    sets = [make_set() for _ in range(k)]

    def run():
        for s in sets:
            fn_of_set(*s)

    ms = graph_ms(run, rep=60)
    return None if ms is None else ms / k


def main(out: str) -> None:
    rows_of = {"4096x3072 bf16": 4096 * 3072 * 2, "6889x3072 bf16": 6889 * 3072 * 2, "4096x3072 fp32": 4096 * 3072 * 4,
               "64 MiB": 64 << 20, "256 MiB": 256 << 20, "1 GiB": 1 << 30}
    res = []
    for label, n in rows_of.items():
        for method in ("torch copy_", "sm copy"):
            for cold in (False, True):
                def make():
                    s = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda").normal_()
                    return s, torch.empty_like(s)
                fn = (lambda s, d: d.copy_(s)) if method == "torch copy_" else sm_copy
                ms = measure(fn, make, 2 * n, cold)
                row = {"size": label, "src_bytes": n, "method": method, "cold": cold, "ms": ms,
                       "gbps": (2 * n / (ms * 1e-3) / 1e9) if ms else None}
                res.append(row)
                print(row, flush=True)
                torch.cuda.empty_cache()
    # the LayerNorm-modulation forward, warm and cold, same sizes
    from mmdit_strict.kernels.triton import norms as N

    for rows, dt in ((4096, torch.bfloat16), (6889, torch.bfloat16), (4096, torch.float32)):
        es = torch.empty((), dtype=dt).element_size()
        nb = 2 * rows * 3072 * es + 2 * 3072 * es
        for cold in (False, True):
            def make():
                x = torch.randn(rows, 3072, device="cuda", dtype=dt)
                return x, torch.randn(1, 3072, device="cuda", dtype=dt), torch.randn(1, 3072, device="cuda", dtype=dt)
            ms = measure(lambda x, sh, sc: N.adaln_modulation_fwd(x, sh, sc, (rows,), 1e-6, False), make, nb, cold)
            row = {"op": "adaln_modulation fwd", "rows": rows, "dtype": str(dt), "cold": cold, "ms": ms,
                   "gbps": nb / (ms * 1e-3) / 1e9 if ms else None}
            res.append(row)
            print(row, flush=True)
    dump(out, res)


def dump(out: str, rows: list[dict]) -> None:
    """The probe's rows and the GPU's name as JSON at ``out`` (each row was printed as it was measured)."""
    with open(out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

"""Probe: do the row kernels lose bandwidth to their power-of-two tiles? Time the LayerNorm-modulation forward and
backward at row widths 3072 (a 4096-lane tile, a quarter masked) and 4096 (none masked), and the fused QK norm +
RoPE forward and backward at 24 heads (a 32-head tile) and 32 heads, same rows, same launch defaults; GB/s over the
copy reference of the same bytes (``bench.bandwidth``). GPU only:  python -m benchmarks.width_probe OUT.json
"""

from __future__ import annotations

import json
import sys

import torch

from mmdit_strict.bench.bandwidth import copy_reference
from mmdit_strict.bench.timing import graph_ms


def main(out: str) -> None:
    from mmdit_strict.kernels.triton import norms as N
    from mmdit_strict.kernels.triton import rope as R

    rows_out = []
    for dt in (torch.bfloat16, torch.float32):
        es = torch.empty((), dtype=dt).element_size()
        for m in (4096, 6889):
            for d in (3072, 4096):
                x, gy = torch.randn(m, d, device="cuda", dtype=dt), torch.randn(m, d, device="cuda", dtype=dt)
                sh, sc = torch.randn(1, d, device="cuda", dtype=dt), torch.randn(1, d, device="cuda", dtype=dt)
                _, mean, rstd = N.adaln_modulation_fwd(x, sh, sc, (m,), 1e-6, True)
                for kind, fn, nb in (("ln fwd", lambda: N.adaln_modulation_fwd(x, sh, sc, (m,), 1e-6, False), 2 * m * d * es),
                                     ("ln bwd", lambda: N.adaln_modulation_bwd(gy, x, sc, mean, rstd, (m,), True), 3 * m * d * es)):
                    ms = graph_ms(fn, rep=40)
                    row = {"kernel": kind, "dtype": str(dt), "rows": m, "width": d, "ms": ms,
                           "fraction": nb / (ms * 1e-3) / 1e9 / copy_reference(nb).best}
                    rows_out.append(row)
                    print(row, flush=True)
            for h in (24, 32):
                x, gy = torch.randn(m, h, 128, device="cuda", dtype=dt), torch.randn(m, h, 128, device="cuda", dtype=dt)
                gain = torch.randn(128, device="cuda", dtype=dt)
                c, s = torch.randn(m, 64, device="cuda"), torch.randn(m, 64, device="cuda")
                _, rs = R.qk_norm_fwd(x, gain, c, s, 1e-6, store_rstd=True)
                for kind, fn, nb in (("qk fused fwd", lambda: R.qk_norm_fwd(x, gain, c, s, 1e-6, store_rstd=False), 2 * m * h * 128 * es),
                                     ("qk fused bwd", lambda: R.qk_norm_bwd(gy, x, gain, rs, c, s, (m,), True), 3 * m * h * 128 * es)):
                    ms = graph_ms(fn, rep=40)
                    row = {"kernel": kind, "dtype": str(dt), "rows": m, "heads": h, "ms": ms,
                           "fraction": nb / (ms * 1e-3) / 1e9 / copy_reference(nb).best}
                    rows_out.append(row)
                    print(row, flush=True)
    with open(out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

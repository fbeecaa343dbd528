"""Probe: do the row kernels lose bandwidth to their power-of-two tiles? Time the LayerNorm-modulation forward and
backward at row widths 3072 (a 4096-lane tile, a quarter masked) and 4096 (none masked), and the fused QK norm +
RoPE forward and backward at 24 heads (a 32-head tile) and 32 heads, same rows, same launch defaults; GB/s over the
copy reference of the same bytes (``bench.bandwidth``). GPU only:  python -m benchmarks.width_probe OUT.json
"""

from __future__ import annotations

import sys

import torch

from mmdit_strict.bench.bandwidth import copy_reference
from mmdit_strict.bench.timing import graph_ms

from .copy_probe import dump


def _timed(rows_out: list[dict], pairs, **labels) -> None:
    """Time each (kernel name, fn, bytes moved) of ``pairs`` and append its row: ms and fraction of the copy."""
    for kind, fn, nb in pairs:
        ms = graph_ms(fn, rep=40)
        row = {"kernel": kind, **labels, "ms": ms, "fraction": nb / (ms * 1e-3) / 1e9 / copy_reference(nb).best}
        rows_out.append(row)
        print(row, flush=True)


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
                _timed(rows_out, (("ln fwd", lambda: N.adaln_modulation_fwd(x, sh, sc, (m,), 1e-6, False), 2 * m * d * es),
                                  ("ln bwd", lambda: N.adaln_modulation_bwd(gy, x, sc, mean, rstd, (m,), True), 3 * m * d * es)),
                       dtype=str(dt), rows=m, width=d)
            for h in (24, 32):
                x, gy = torch.randn(m, h, 128, device="cuda", dtype=dt), torch.randn(m, h, 128, device="cuda", dtype=dt)
                gain = torch.randn(128, device="cuda", dtype=dt)
                c, s = torch.randn(m, 64, device="cuda"), torch.randn(m, 64, device="cuda")
                _, rs = R.qk_norm_fwd(x, gain, c, s, 1e-6, store_rstd=True)
                _timed(rows_out, (("qk fused fwd", lambda: R.qk_norm_fwd(x, gain, c, s, 1e-6, store_rstd=False), 2 * m * h * 128 * es),
                                  ("qk fused bwd", lambda: R.qk_norm_bwd(gy, x, gain, rs, c, s, (m,), True), 3 * m * h * 128 * es)),
                       dtype=str(dt), rows=m, heads=h)
    dump(out, rows_out)


if __name__ == "__main__":
    main(sys.argv[1])

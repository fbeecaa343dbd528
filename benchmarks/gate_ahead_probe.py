"""Probe: rows read ahead by the gated-residual backward in thirds (``norms.GATE_BWD_AHEAD``), a launch choice.

At 4096 rows of 3072 the backward has 256 programs (one 16-row chunk each), about two per SM, and each reads one
row ahead: few bytes are in flight per SM, and it ran 0.72 of the copy at 6de295f against 0.80 at 6889 rows
(431 programs). This times ``ahead`` 1..3 and the one-tile kernel (CUDA-graph replay, the fold included, as the
qualification's backward) beside the copy of the same bytes (read dout and y, write dy), and checks that every
variant gives the one-tile kernel's bytes for dy and d_gate.

GPU only:  python -m benchmarks.gate_ahead_probe OUT.json
"""

from __future__ import annotations

import sys

import torch

from mmdit_strict.bench.attention import _same_bytes
from mmdit_strict.bench.bandwidth import copy_reference
from mmdit_strict.bench.timing import graph_ms

from .copy_probe import dump

D = 3072


def main(out: str) -> None:
    from mmdit_strict.kernels.triton import norms as N

    rows_out = []
    for dt in (torch.bfloat16, torch.float32):
        es = torch.empty((), dtype=dt).element_size()
        for m in (4096, 6889):
            dout, y = (torch.randn(m, D, device="cuda", dtype=dt) for _ in range(2))
            gate = torch.randn(1, D, device="cuda", dtype=dt)
            nb = 3 * m * D * es
            copy = copy_reference(nb).best
            want = N.gate_residual_bwd(dout, y, gate, (m,), True, True, thirds=False)
            cases = [("one 4096-lane tile, one row ahead", dict(thirds=False))]
            cases += [(f"thirds, {a} row(s) ahead", dict(thirds=True, ahead=a)) for a in (1, 2, 3)]
            for label, kw in cases:
                fn = lambda kw=kw: N.gate_residual_bwd(dout, y, gate, (m,), True, True, **kw)  # noqa: E731
                got = fn()
                ms = graph_ms(fn, rep=40)
                rows_out.append({"kernel": label, "dtype": str(dt), "rows": m, "ms": ms,
                                 "fraction": nb / (ms * 1e-3) / 1e9 / copy,
                                 "bytes_equal_one_tile": _same_bytes(list(got), list(want))})
                print(rows_out[-1], flush=True)
    dump(out, rows_out)


if __name__ == "__main__":
    main(sys.argv[1])

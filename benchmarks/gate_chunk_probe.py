"""Probe: the gated-residual backward with longer d_gate chunks and other column blocks.

The backward's only cross-row sum is d_gate, whose chunk partials (one FP32 row of D a chunk) are written once and
read back by the fold: 3.1 MB at 4096 rows with 16-row chunks, 8 % more traffic than the bytes counted. Its rows
have no sum across columns, so a chunk's columns already split over programs (``GATE_BWD_COLS``), and longer
chunks need not cost parallelism: 32-row chunks of 1024 columns are still 384 programs at 4096 rows. Another
chunk length is another d_gate tree (**other d_gate bytes**; dy keeps its bytes).

For chunk lengths 16 (the product), 32, 64 and columns a program 1024 / 512: CUDA-graph time (dy and d_gate, the
fold included) beside the copy of the same bytes (dout, y read; dy written), bf16 and fp32, 4096 / 6889 rows;
dy's bytes against the product's, d_gate's error against FP64.

GPU only:  python -m benchmarks.gate_chunk_probe OUT.json
"""

from __future__ import annotations

import sys

import torch

from mmdit_strict.bench.bandwidth import copy_reference
from mmdit_strict.bench.timing import graph_ms
from mmdit_strict.kernels.triton import norms as N

from .copy_probe import dump

D = 3072


def main(out: str) -> None:
    rows = []
    for dt in (torch.bfloat16, torch.float32):
        es = torch.empty((), dtype=dt).element_size()
        w = torch.int16 if es == 2 else torch.int32
        for m in (4096, 6889):
            g = torch.Generator(device="cpu").manual_seed(m)
            dout, y = (torch.randn(m, D, generator=g).to("cuda", dt) for _ in range(2))
            gate = (0.5 * torch.randn(1, D, generator=g)).to("cuda", dt)
            want = (dout.double() * y.double()).sum(0, keepdim=True)
            nb = 3 * m * D * es
            copy = copy_reference(nb).best
            ref_dy = N.gate_residual_bwd(dout, y, gate, (m,), True, True)[0]
            for ch in (16, 32, 64):
                for cols in (1024, 512):
                    fn = lambda: N.gate_residual_bwd(dout, y, gate, (m,), True, True, cols=cols, chunk_rows=ch)  # noqa: E731
                    dy, dg = fn()
                    ms = graph_ms(fn, rep=40)
                    rows.append({"op": "adaln_gate_residual bwd", "dtype": str(dt), "rows": m, "chunk_rows": ch,
                                 "cols": cols, "ms": ms, "fraction": nb / (ms * 1e-3) / 1e9 / copy,
                                 "dy_bytes_equal_product": torch.equal(dy.view(w), ref_dy.view(w)),
                                 "dgate_err_over_max": float((dg.double() - want).abs().max()) / float(want.abs().max())})
                    print(rows[-1], flush=True)
    dump(out, rows)


if __name__ == "__main__":
    main(sys.argv[1])

"""Probe: the per-sample fold of chunk partials (``segments._segment_fold_kernel``) and what it costs the backwards.

Nsight Compute at c8b4c70 (``experiments/norms/c8b4c70_ncu``) saw the LayerNorm backward's fold as 96 programs of
4 warps at 6 % achieved occupancy, 8.1 µs cold, and in graph replay the partials and fold took about a fifth of
the bf16 LayerNorm backward. This times, CUDA-graph replay:

* the fold alone for the LayerNorm's (n_chunks, 2·3072) and the gated residual's (n_chunks, 3072) partials at
  4096 and 6889 rows (256 and 431 chunks): the product launch, its tile loop pipelined deeper
  (``_FOLD_STAGES``: same layout, same tree, so the bytes must be equal), and other column blocks and warps
  (another layout, so possibly another tree: bytes reported, not required). At aaa56a1, where this ran, the
  product took 64 columns; since 1d3c130 it takes 16.

At aaa56a1 the probe also timed the bf16 LayerNorm and gated-residual backwards end to end with each stage count
(by switching the module's constant); they timed equal (``experiments/norms/aaa56a1_fold``), so that part is gone
and the fold's launch takes its block, warps and stages as arguments instead.

GPU only:  python -m benchmarks.fold_probe OUT.json
"""

from __future__ import annotations

import sys

import torch
import triton

from mmdit_strict.bench.attention import _same_bytes
from mmdit_strict.bench.bandwidth import copy_reference
from mmdit_strict.bench.timing import graph_ms

from .copy_probe import dump

D = 3072
STAGES = (2, 3, 4, 6)


def _fold(part: torch.Tensor, seg: torch.Tensor, block_n: int, warps: int, stages: int) -> torch.Tensor:
    from mmdit_strict.kernels.triton import segments as S

    out = torch.empty((1, part.shape[1]), dtype=torch.float32, device=part.device)
    S._launch_fold(part, seg, 1, out, S.TILES, interpreting=False, block_n=block_n, warps=warps, stages=stages)
    return out


def main(out: str) -> None:
    from mmdit_strict.kernels.triton import segments as S

    rows_out = []
    for m in (4096, 6889):
        n_chunks = triton.cdiv(m, S.CHUNK_ROWS)
        seg = torch.tensor([0, n_chunks], dtype=torch.int32, device="cuda")
        for width, what in ((2 * D, "LayerNorm partials"), (D, "gated-residual partials")):
            part = torch.randn(n_chunks, width, device="cuda")
            want = _fold(part, seg, S._FOLD_BLOCK_N, 4, 2)
            copy = copy_reference(part.numel() * 4).best
            others = [(b, w, 4) for b, w in ((64, 4), (32, 4), (16, 4), (16, 2), (32, 2)) if (b, w) != (S._FOLD_BLOCK_N, 4)]
            variants = [(S._FOLD_BLOCK_N, 4, st) for st in STAGES] + others
            for block_n, warps, stages in variants:
                fn = lambda b=block_n, w=warps, s=stages: _fold(part, seg, b, w, s)  # noqa: E731
                got = fn()
                ms = graph_ms(fn, rep=40)
                rows_out.append({"kernel": f"fold of {what}, BLOCK_N {block_n}, {warps} warps, {stages} stages",
                                 "rows": m, "chunks": n_chunks, "ms": ms,
                                 "read_fraction_of_copy": part.numel() * 4 / (ms * 1e-3) / 1e9 / copy,
                                 "bytes_equal_product": _same_bytes([got], [want])})
                print(rows_out[-1], flush=True)
    dump(out, rows_out)


if __name__ == "__main__":
    main(sys.argv[1])

"""Probe: the QK-norm backward (alone and fused with RoPE) with shorter d_gain chunks.

The backward gives each program one chunk of ``segments.CHUNK_ROWS`` (16) tokens, walked in order (the chain of
the d_gain partials), so 4096 tokens are 256 programs, about two per SM. The LayerNorm backward cannot shorten
its chunks cheaply (a partial row of 6144 FP32 per chunk), but the QK norm's partial is one head wide (128
FP32 per chunk), so 4-token chunks cost 0.5 MB of partials at 4096 tokens and give four times the programs.
Another chunk length is another d_gain tree (**other d_gain bytes**; dx is row-local and keeps its bytes).

For chunk lengths 16 (the product), 8, 4 and 2: CUDA-graph time of the backward (dx and d_gain, the fold
included) beside the copy of the same bytes (x, dy read, dx written; the fused op also reads its cos/sin
tables), bf16 and fp32, 4096 and 6889 tokens of 24 heads x 128; dx compared with the product's bytes, d_gain's
error against FP64.

GPU only:  python -m benchmarks.qk_chunk_probe OUT.json
"""

from __future__ import annotations

import sys

import torch

from mmdit_strict.bench.bandwidth import copy_reference
from mmdit_strict.bench.timing import graph_ms
from mmdit_strict.kernels.triton import rope as R

from .copy_probe import dump

H, D = 24, 128


def _fp64_dgain(dy, x, cos, sin):
    """d_gain in FP64: Σ over tokens and heads of (rotated-back dy)·x̂."""
    xd = x.double()
    xh = xd * torch.rsqrt((xd * xd).mean(-1, keepdim=True) + 1e-6)
    d = dy.double()
    if cos is not None:
        c, s = cos.double()[:, None, :], sin.double()[:, None, :]
        de, do = d[..., 0::2], d[..., 1::2]
        d = torch.stack((de * c + do * s, do * c - de * s), dim=-1).reshape(d.shape)
    return (d * xh).sum((0, 1))


def main(out: str) -> None:
    rows = []
    for dt in (torch.bfloat16, torch.float32):
        es = torch.empty((), dtype=dt).element_size()
        for m in (4096, 6889):
            g = torch.Generator(device="cpu").manual_seed(m)
            x = torch.randn(m, H, D, generator=g).to("cuda", dt)
            dy = torch.randn(m, H, D, generator=g).to("cuda", dt)
            gain = (1 + 0.1 * torch.randn(D, generator=g)).to("cuda", dt)
            ang = torch.rand(m, D // 2, generator=g) * 6.28
            cos, sin = ang.cos().cuda(), ang.sin().cuda()
            _, rstd = R.qk_norm_fwd(x, gain, None, None, 1e-6, True)
            for fused in (False, True):
                cs = (cos, sin) if fused else (None, None)
                nb = 3 * m * H * D * es + (2 * m * (D // 2) * 4 if fused else 0)
                copy = copy_reference(nb).best
                want = _fp64_dgain(dy, x, *cs)
                ref_dx = None
                for ch in (16, 8, 4, 2):
                    fn = lambda: R.qk_norm_bwd(dy, x, gain, rstd, *cs, (m,), True, chunk_rows=ch)  # noqa: E731
                    dx, dg = fn()
                    ref_dx = dx if ref_dx is None else ref_dx
                    ms = graph_ms(fn, rep=40)
                    row = {"op": "qk_rmsnorm_rope (fused)" if fused else "qk_rmsnorm", "dtype": str(dt), "rows": m,
                           "chunk_rows": ch, "ms": ms, "fraction": nb / (ms * 1e-3) / 1e9 / copy,
                           "dx_bytes_equal_16": torch.equal(dx.view(torch.int16 if es == 2 else torch.int32),
                                                            ref_dx.view(torch.int16 if es == 2 else torch.int32)),
                           "dgain_err_over_max": float((dg.double() - want).abs().max()) / float(want.abs().max())}
                    rows.append(row)
                    print(row, flush=True)
            del x, dy
            torch.cuda.empty_cache()
    dump(out, rows)


if __name__ == "__main__":
    main(sys.argv[1])

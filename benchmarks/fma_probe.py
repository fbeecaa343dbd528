"""Probe: what multiply-add contraction would buy the issue-bound bf16 row kernels (an upper bound, not a product).

Every strict kernel compiles with ``enable_fp_fusion=False``: each multiply and each add is its own IEEE rounding,
in the order the source writes them. Nsight saw the bf16 row kernels issue-bound (0.63 warp instructions per
cycle), so fewer floating-point instructions might be what they lack. This probe recompiles the same kernels with
``enable_fp_fusion=True`` (ptxas may then contract any ``a*b + c`` into one FMA: other bytes, still deterministic)
and times both builds, kernels alone, CUDA-graph replay, B = 1, against the copy reference of the same bytes. If
contraction everywhere does not lift a kernel to 0.8 of the copy, no hand-placed ``tl.fma`` will.

Also timed: the LayerNorm and QK-norm backwards without their per-sample vectors (dx only), the ceiling of those
kernels under the fixed per-sample tree (the chunk partials and their fold come on top of it).

GPU only:  python -m benchmarks.fma_probe OUT.json
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

import torch

from mmdit_strict.bench.attention import _same_bytes
from mmdit_strict.bench.bandwidth import copy_reference
from mmdit_strict.bench.timing import graph_ms

from .copy_probe import dump

D, H, HD = 3072, 24, 128


@contextlib.contextmanager
def fp_fusion(on: bool) -> Iterator[None]:
    """Launch the norms / rope kernels with ``enable_fp_fusion=on`` inside the block (module globals swapped)."""
    from mmdit_strict.kernels.triton import norms as N
    from mmdit_strict.kernels.triton import rope as R

    saved = N.launch_opts, R.launch_opts

    def opts(num_warps: int, interpreting: bool, **limits: int | None) -> dict:
        return {**saved[0](num_warps, interpreting, **limits), "enable_fp_fusion": on}

    N.launch_opts = R.launch_opts = opts
    try:
        yield
    finally:
        N.launch_opts, R.launch_opts = saved


def _cases(m: int, dt: torch.dtype) -> list[tuple[str, int, Callable[[], object]]]:
    from mmdit_strict.kernels.triton import norms as N
    from mmdit_strict.kernels.triton import rope as R

    g = torch.Generator(device="cuda").manual_seed(7)
    es = torch.finfo(dt).bits // 8
    x, dy = (torch.randn(m, D, device="cuda", generator=g).to(dt) for _ in range(2))
    shift, scale, gate = (0.1 * torch.randn(1, D, device="cuda", generator=g)).to(dt), \
        (0.1 * torch.randn(1, D, device="cuda", generator=g)).to(dt), (0.5 * torch.randn(1, D, device="cuda", generator=g)).to(dt)
    seq = (m,)
    _, mean, rstd = N.adaln_modulation_fwd(x, shift, scale, seq, 1e-6, store_stats=True)
    q, gq = x.view(m, H, HD), dy.view(m, H, HD)
    gain = (1 + 0.1 * torch.randn(HD, device="cuda", generator=g)).to(dt)
    ang = torch.rand(m, HD // 2, device="cuda", generator=g) * 6.0
    cos, sin = torch.cos(ang), torch.sin(ang)
    _, qr = R.qk_norm_fwd(q, gain, cos, sin, 1e-6, store_rstd=True)
    _, qn = R.qk_norm_fwd(q, gain, None, None, 1e-6, store_rstd=True)
    row = m * D * es
    return [
        ("LayerNorm fwd", 2 * row, lambda: N.adaln_modulation_fwd(x, shift, scale, seq, 1e-6, store_stats=False)[0]),
        ("LayerNorm bwd", 3 * row, lambda: N.adaln_modulation_bwd(dy, x, scale, mean, rstd, seq, need_vec=True)),
        ("LayerNorm bwd, dx only", 3 * row, lambda: N.adaln_modulation_bwd(dy, x, scale, mean, rstd, seq, need_vec=False)[0]),
        ("gated residual bwd", 3 * row, lambda: N.gate_residual_bwd(dy, x, gate, seq, need_dy=True, need_gate=True)),
        ("fused QK norm + RoPE fwd", 2 * row, lambda: R.qk_norm_fwd(q, gain, cos, sin, 1e-6, store_rstd=False)[0]),
        ("fused QK norm + RoPE bwd", 3 * row, lambda: R.qk_norm_bwd(gq, q, gain, qr, cos, sin, seq, True)),
        ("fused QK norm + RoPE bwd, dx only", 3 * row, lambda: R.qk_norm_bwd(gq, q, gain, qr, cos, sin, seq, False)[0]),
        ("QK norm bwd", 3 * row, lambda: R.qk_norm_bwd(gq, q, gain, qn, None, None, seq, True)),
        ("QK norm bwd, dx only", 3 * row, lambda: R.qk_norm_bwd(gq, q, gain, qn, None, None, seq, False)[0]),
    ]


def main(out: str) -> None:
    rows = []
    for dt, m in ((torch.bfloat16, 4096), (torch.bfloat16, 6889), (torch.float32, 4096)):
        for name, moved, fn in _cases(m, dt):
            copy = copy_reference(moved).best
            res = {}
            for on in (False, True):
                with fp_fusion(on):
                    got = fn()
                    ms = graph_ms(fn, rep=40)
                res[on] = (got if isinstance(got, tuple) else (got,), ms)
            (off_t, off_ms), (on_t, on_ms) = res[False], res[True]
            rows.append({"kernel": name, "dtype": str(dt).removeprefix("torch."), "rows": m, "copy_gb_s": copy,
                         "ms_no_fma": off_ms, "ms_fma": on_ms,
                         "fraction_no_fma": moved / (off_ms * 1e-3) / 1e9 / copy,
                         "fraction_fma": moved / (on_ms * 1e-3) / 1e9 / copy,
                         "bytes_equal": _same_bytes([t for t in off_t if t is not None], [t for t in on_t if t is not None])})
            print(rows[-1], flush=True)
    dump(out, rows)


if __name__ == "__main__":
    main(sys.argv[1])

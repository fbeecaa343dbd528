"""Hardware counters of the bf16 row kernels beside an SM copy of the same bytes, for Nsight Compute (GPU only).

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
        python -m benchmarks.ncu_rows [ROWS]

Every kernel runs once untimed first (compile, autotune-free warm-up), then once more between
``cudaProfilerStart`` / ``cudaProfilerStop``, so ncu (``--profile-from-start off``) records exactly one
launch of each: the LayerNorm-modulation forward and backward (with and without d_scale / d_shift) and the
gated-residual backward (``ROWS`` × 3072, one sample), the fused QK
norm + RoPE forward and backward (``ROWS`` × 24 heads × 128), and the SM copy kernel moving the LayerNorm
forward's bytes (read ``ROWS`` × 3072, write as many). The question it answers: where the row kernels'
time goes when they reach 0.55-0.7 of the copy's bandwidth (DRAM throughput, occupancy, stall reasons).
"""

from __future__ import annotations

import sys

import torch

from mmdit_strict.bench.bandwidth import sm_copy


def main(rows: int = 4096) -> None:
    from mmdit_strict.kernels.triton import norms as N
    from mmdit_strict.kernels.triton import rope as R

    dt, d, h = torch.bfloat16, 3072, 24
    x, gy = torch.randn(rows, d, device="cuda", dtype=dt), torch.randn(rows, d, device="cuda", dtype=dt)
    sh, sc = torch.randn(1, d, device="cuda", dtype=dt), torch.randn(1, d, device="cuda", dtype=dt)
    q, gq = torch.randn(rows, h, 128, device="cuda", dtype=dt), torch.randn(rows, h, 128, device="cuda", dtype=dt)
    gain = torch.randn(128, device="cuda", dtype=dt)
    c, s = torch.randn(rows, 64, device="cuda"), torch.randn(rows, 64, device="cuda")
    dst = torch.empty_like(x)
    _, mean, rstd = N.adaln_modulation_fwd(x, sh, sc, (rows,), 1e-6, True)
    _, rs = R.qk_norm_fwd(q, gain, c, s, 1e-6, store_rstd=True)
    calls = (
        ("sm copy of the LN forward's bytes", lambda: sm_copy(x, dst)),
        ("adaln_modulation fwd", lambda: N.adaln_modulation_fwd(x, sh, sc, (rows,), 1e-6, False)),
        ("adaln_modulation bwd", lambda: N.adaln_modulation_bwd(gy, x, sc, mean, rstd, (rows,), True)),
        ("adaln_modulation bwd, dx only", lambda: N.adaln_modulation_bwd(gy, x, sc, mean, rstd, (rows,), False)),
        ("adaln_gate_residual bwd", lambda: N.gate_residual_bwd(gy, x, sc, (rows,), True, True)),
        ("qk_rmsnorm_rope fwd", lambda: R.qk_norm_fwd(q, gain, c, s, 1e-6, store_rstd=False)),
        ("qk_rmsnorm_rope bwd", lambda: R.qk_norm_bwd(gq, q, gain, rs, c, s, (rows,), True)),
    )
    for _, fn in calls:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in calls:
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled, in order:", "; ".join(name for name, _ in calls), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)

"""Probe: the modulation GEMVs (one row per sample) on the strict GEMM engine, by tile, before a config change.

``final_adaln_out`` runs ``SiLU(temb) Wᵀ + b`` (W 6144 x 3072 bf16, 37.7 MB) before its LayerNorm; at 4096 rows
the GEMV is more than half the operator's time, at about half the weight-streaming bandwidth (0.019 ms, H200 at
82e3f0f). Its tile (16 x 64 x 128, 4 warps, 4 stages) gives 96 programs for 132 SMs. A narrower BLOCK_N keeps
BLOCK_M and BLOCK_K, hence each output element's accumulator chain (the same mma instruction on the same K
steps), and gives more programs; a longer BLOCK_K is a new chain (other bytes), shown for comparison only.

For each candidate: CUDA-graph time at M = 1 and 2, the weight's GB/s and its fraction of the copy of the same
bytes (same run), whether the output is byte-equal to the incumbent configuration's, and cuBLAS
(``F.linear(F.silu(t), W, b)``) beside it; then the whole ``final_adaln_out`` at 4096 / 6889 rows with the
incumbent and the fastest byte-equal candidate (the operator's bytes: x, y and W).

Last, the FP32 ``txt_in`` product (256 text rows, 3584 -> 3072; the strict engine's IEEE FMA dot), where the
operator runs at 0.74x eager: its 64 x 128 x 32 tile gives 96 programs. Smaller tiles with the same 32-wide K
step, timed beside cuBLAS FP32 (TF32 off) with the bytes compared to the incumbent's.

GPU only:  python -m benchmarks.gemv_probe OUT.json
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from mmdit_strict.bench.bandwidth import copy_reference
from mmdit_strict.bench.timing import graph_ms
from mmdit_strict.kernels.triton import configs as C
from mmdit_strict.kernels.triton import norms as N
from mmdit_strict.kernels.triton.gemm.launch import gemm_bwd, gemm_fwd

from .copy_probe import dump

FwdConfig = C.FwdConfig


def _candidates(n: int, k: int) -> list[tuple[str, FwdConfig]]:
    base = C.fwd_config(n, k, torch.bfloat16)
    out = [("incumbent", base)]
    for bn, w, s, tma in ((64, 4, 6, True), (64, 4, 8, True), (32, 4, 4, True), (32, 4, 6, True), (32, 4, 8, True),
                          (32, 2, 6, True), (32, 4, 6, False), (16, 4, 6, True), (16, 2, 8, True), (16, 4, 8, True),
                          (128, 4, 6, True), (128, 8, 4, True)):
        if bn == base.BLOCK_N and w == base.num_warps and s == base.num_stages and tma == base.tma:
            continue
        out.append((f"16x{bn}x{base.BLOCK_K} w{w} s{s}{' tma' if tma else ''}",
                    base.replace(BLOCK_N=bn, num_warps=w, num_stages=s, tma=tma)))
    out.append(("incumbent, SiLU fused", base.replace(prologue="fused")))
    out.append((f"16x32x{base.BLOCK_K} w4 s6 tma, SiLU fused", base.replace(BLOCK_N=32, num_warps=4, num_stages=6, prologue="fused")))
    other_k = 256 if base.BLOCK_K != 256 else 128
    out.append((f"16x32x{other_k} w4 s4 tma (other chain)", base.replace(BLOCK_N=32, BLOCK_K=other_k, num_warps=4, num_stages=4)))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def main(out: str) -> None:
    rows = []
    dt = torch.bfloat16
    best: dict[tuple[int, int], tuple[float, FwdConfig]] = {}
    for n, k, label in ((6144, 3072, "final modulation"), (18432, 3072, "block modulation")):
        g = torch.Generator(device="cpu").manual_seed(n)
        w = (torch.randn(n, k, generator=g) * k**-0.5).to("cuda", dt)
        bias = (0.1 * torch.randn(n, generator=g)).to("cuda", dt)
        wbytes = n * k * 2
        copy = copy_reference(wbytes).best
        for m in (1, 2):
            t = torch.randn(m, k, generator=g).to("cuda", dt)
            cub = graph_ms(lambda: F.linear(F.silu(t), w, bias), rep=40)
            rows.append({"layer": label, "N": n, "K": k, "M": m, "kernel": "cuBLAS F.linear(F.silu)", "ms": cub,
                         "weight_gbps": wbytes / (cub * 1e-3) / 1e9, "fraction": wbytes / (cub * 1e-3) / 1e9 / copy})
            print(rows[-1], flush=True)
            want = None
            for name, cfg in _candidates(n, k):
                try:
                    y = gemm_fwd(t, w, bias, prologue="silu", config=cfg)[0]
                    want = y if want is None else want
                    ms = graph_ms(lambda: gemm_fwd(t, w, bias, prologue="silu", config=cfg), rep=40)
                    row = {"layer": label, "N": n, "K": k, "M": m, "kernel": name, "config": cfg.as_dict(), "ms": ms,
                           "weight_gbps": wbytes / (ms * 1e-3) / 1e9, "fraction": wbytes / (ms * 1e-3) / 1e9 / copy,
                           "vs_cublas": cub / ms, "bytes_equal_incumbent": _same(y, want)}
                    if m == 1 and row["bytes_equal_incumbent"] and ms < best.get((n, k), (1e9, None))[0]:
                        best[(n, k)] = (ms, cfg)
                except Exception as e:  # noqa: BLE001 - a candidate that does not compile is reported
                    row = {"layer": label, "N": n, "K": k, "M": m, "kernel": name, "error": repr(e)[:300]}
                rows.append(row)
                print(row, flush=True)
    # the whole operator with the incumbent and the fastest byte-equal candidate of the final modulation
    incumbent = C.FWD[(6144, 3072, "bf16")]
    for m_rows in (4096, 6889):
        g = torch.Generator(device="cpu").manual_seed(m_rows)
        x = torch.randn(m_rows, 3072, generator=g).to("cuda", dt)
        temb = torch.randn(1, 3072, generator=g).to("cuda", dt)
        w = (torch.randn(6144, 3072, generator=g) * 3072**-0.5).to("cuda", dt)
        bias = (0.1 * torch.randn(6144, generator=g)).to("cuda", dt)
        nb = 2 * m_rows * 3072 * 2 + 6144 * 3072 * 2
        copy = copy_reference(nb).best
        ys = []
        for name, cfg in (("incumbent", incumbent), ("fastest byte-equal", best.get((6144, 3072), (0, incumbent))[1])):
            def fn(cfg=cfg):  # final_adaln_out's two steps, the modulation product on ``cfg`` (passed, not installed)
                mod = gemm_fwd(temb, w, bias, prologue="silu", config=cfg)[0]
                return N.adaln_modulation(x, mod[:, 3072:], mod[:, :3072], seqlens=(m_rows,), eps=1e-6)

            ys.append(fn())
            ms = graph_ms(fn, rep=40)
            rows.append({"layer": "final_adaln_out", "rows": m_rows, "kernel": name, "config": cfg.as_dict(), "ms": ms,
                         "gbps": nb / (ms * 1e-3) / 1e9, "fraction": nb / (ms * 1e-3) / 1e9 / copy,
                         "bytes_equal_incumbent": _same(ys[-1], ys[0])})
            print(rows[-1], flush=True)
    rows += _txt_in_fp32()
    dump(out, rows)


def _txt_in_fp32() -> list[dict]:
    rows = []
    n, k, m = 3072, 3584, 256
    g = torch.Generator(device="cpu").manual_seed(7)
    x = torch.randn(m, k, generator=g).cuda()
    w = (torch.randn(n, k, generator=g) * k**-0.5).cuda()
    bias = (0.1 * torch.randn(n, generator=g)).cuda()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        cub = graph_ms(lambda: F.linear(x, w, bias), rep=40)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    rows.append({"layer": "txt_in fp32", "M": m, "kernel": "cuBLAS F.linear (TF32 off)", "ms": cub})
    print(rows[-1], flush=True)
    base = C._BIG_FP32  # the tile txt_in had before its text-row entry
    want = None
    for bm, bn, wp, st in ((base.BLOCK_M, base.BLOCK_N, base.num_warps, base.num_stages), (32, 128, 4, 3), (32, 64, 4, 3),
                           (64, 64, 4, 3), (32, 64, 2, 4), (16, 128, 4, 3), (16, 64, 4, 4), (64, 128, 8, 3), (128, 64, 8, 3)):
        cfg = base.replace(BLOCK_M=bm, BLOCK_N=bn, num_warps=wp, num_stages=st)
        try:
            y = gemm_fwd(x, w, bias, config=cfg)[0]
            want = y if want is None else want
            ms = graph_ms(lambda: gemm_fwd(x, w, bias, config=cfg), rep=40)
            row = {"layer": "txt_in fp32", "M": m, "kernel": f"{bm}x{bn}x{cfg.BLOCK_K} w{wp} s{st}", "config": cfg.as_dict(),
                   "ms": ms, "vs_cublas": cub / ms,
                   "bytes_equal_incumbent": torch.equal(y.view(torch.int32), want.view(torch.int32))}
        except Exception as e:  # noqa: BLE001
            row = {"layer": "txt_in fp32", "M": m, "kernel": f"{bm}x{bn} w{wp} s{st}", "error": repr(e)[:300]}
        rows.append(row)
        print(row, flush=True)
    # dX of txt_in (3584 outputs over K = 3072) and the fp32 text stream's other classes, incumbent vs 32 x 64
    small = FwdConfig(32, 64, 32, 4, 3)
    dz = torch.randn(m, n, generator=g).cuda()
    dxs = []
    for name, cfg in (("_BIG_FP32 (64x128x32 w4 s3)", C._BIG_FP32), ("32x64x32 w4 s3", small)):
        fn = lambda: gemm_bwd(dz, x, w, seqlens=(m,), needs=(True, False, False, False, False), dx_config=cfg)  # noqa: E731
        dxs.append(fn()[0])
        ms = graph_ms(fn, rep=40)
        rows.append({"layer": "txt_in fp32 dX", "M": m, "kernel": name, "ms": ms,
                     "bytes_equal_incumbent": torch.equal(dxs[-1].view(torch.int32), dxs[0].view(torch.int32))})
        print(rows[-1], flush=True)
    for n2, k2 in ((3072, 3072), (3072, 12288)):
        x2 = torch.randn(m, k2, generator=g).cuda()
        w2 = (torch.randn(n2, k2, generator=g) * k2**-0.5).cuda()
        ys = []
        for name, cfg in (("incumbent", C.fwd_config(n2, k2, torch.float32, stream="text")), ("32x64x32 w4 s3", small)):
            ys.append(gemm_fwd(x2, w2, None, config=cfg)[0])
            ms = graph_ms(lambda: gemm_fwd(x2, w2, None, config=cfg), rep=40)
            rows.append({"layer": f"text fp32 {n2}x{k2}", "M": m, "kernel": name, "config": cfg.as_dict(), "ms": ms,
                         "bytes_equal_incumbent": torch.equal(ys[-1].view(torch.int32), ys[0].view(torch.int32))})
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main(sys.argv[1])

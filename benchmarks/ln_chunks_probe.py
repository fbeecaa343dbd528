"""Probe: the LayerNorm-modulation forward with its 3072-wide row held as three 1024-lane chunks (no masked lanes).

The product kernel (``kernels/triton/norms.py``) holds a row of 3072 as one 4096-lane tile with a quarter of the
lanes masked. Nsight Compute at e467669 (``experiments/norms/c8b4c70_ncu``) shows that kernel issue-limited, not
DRAM-limited (0.65 warp instructions issued per scheduler cycle, 34 % of DRAM peak; ~20 instructions per lane a
row, masked lanes included), so the masked quarter costs time. This probe's kernel is a **candidate with other
bytes** (a new reduction tree: per lane ``(x[j] + x[j+1024]) + x[j+2048]``, then ``tl.sum`` over the 1024 lanes;
the same for the squared deviations), written here to measure the gain before any product change:

* time (CUDA-graph replay) beside the product kernel and the copy reference of the same bytes, by warps and rows
  per program, bf16 and fp32, 4096 and 6889 rows;
* max abs error of both kernels against an FP64 LayerNorm-modulation of the same inputs (one sample).

GPU only:  python -m benchmarks.ln_chunks_probe OUT.json
           python -m benchmarks.ln_chunks_probe --table OUT.json  (the product's thirds forward beside the probe
           with and without a dependent table load for the row: where the product loses the probe's gain)
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from mmdit_strict.bench.attention import _same_bytes
from mmdit_strict.bench.bandwidth import copy_reference
from mmdit_strict.bench.timing import graph_ms

from .copy_probe import dump

C = 1024  # lanes per chunk; three chunks make the Qwen-Image row of 3072


@triton.jit
def _ln3_fwd_kernel(x_ptr, shift_ptr, scale_ptr, y_ptr, M, d_float, eps, ROWS: tl.constexpr, C: tl.constexpr):
    """y = x̂·(1 + scale) + shift for ROWS rows of 3·C (one sample); mean and variance over the three chunks."""
    cols = tl.arange(0, C)
    s0 = 1.0 + tl.load(scale_ptr + cols).to(tl.float32)
    s1 = 1.0 + tl.load(scale_ptr + C + cols).to(tl.float32)
    s2 = 1.0 + tl.load(scale_ptr + 2 * C + cols).to(tl.float32)
    h0 = tl.load(shift_ptr + cols).to(tl.float32)
    h1 = tl.load(shift_ptr + C + cols).to(tl.float32)
    h2 = tl.load(shift_ptr + 2 * C + cols).to(tl.float32)
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        ok = (cols * 0 + row) < M
        base = row.to(tl.int64) * (3 * C)
        x0 = tl.load(x_ptr + base + cols, mask=ok, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + base + C + cols, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + base + 2 * C + cols, mask=ok, other=0.0).to(tl.float32)
        mean = tl.div_rn(tl.sum((x0 + x1) + x2, axis=0), d_float)
        c0, c1, c2 = x0 - mean, x1 - mean, x2 - mean
        var = tl.div_rn(tl.sum((c0 * c0 + c1 * c1) + c2 * c2, axis=0), d_float)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
        dt = y_ptr.dtype.element_ty
        tl.store(y_ptr + base + cols, ((c0 * rstd) * s0 + h0).to(dt), mask=ok)
        tl.store(y_ptr + base + C + cols, ((c1 * rstd) * s1 + h1).to(dt), mask=ok)
        tl.store(y_ptr + base + 2 * C + cols, ((c2 * rstd) * s2 + h2).to(dt), mask=ok)


@triton.jit
def _ln3_bwd_kernel(x_ptr, scale_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr, M, d_float,
                    ROWS: tl.constexpr, C: tl.constexpr):
    """dx of ROWS rows of 3·C (one sample; the row sums over the three chunks as in the forward), and the
    program's per-column partials part[p, :3C] = Σ dy·x̂, part[p, 3C:] = Σ dy in row order (the product's)."""
    cols = tl.arange(0, C)
    s0 = 1.0 + tl.load(scale_ptr + cols).to(tl.float32)
    s1 = 1.0 + tl.load(scale_ptr + C + cols).to(tl.float32)
    s2 = 1.0 + tl.load(scale_ptr + 2 * C + cols).to(tl.float32)
    a0 = tl.zeros((C,), tl.float32)
    a1 = tl.zeros((C,), tl.float32)
    a2 = tl.zeros((C,), tl.float32)
    b0 = tl.zeros((C,), tl.float32)
    b1 = tl.zeros((C,), tl.float32)
    b2 = tl.zeros((C,), tl.float32)
    p = tl.program_id(0)
    for i in range(ROWS):
        row = p * ROWS + i
        ok = (cols * 0 + row) < M
        base = row.to(tl.int64) * (3 * C)
        mean = tl.load(mean_ptr + row, mask=row < M, other=0.0)
        rstd = tl.load(rstd_ptr + row, mask=row < M, other=0.0)
        x0 = (tl.load(x_ptr + base + cols, mask=ok, other=0.0).to(tl.float32) - mean) * rstd
        x1 = (tl.load(x_ptr + base + C + cols, mask=ok, other=0.0).to(tl.float32) - mean) * rstd
        x2 = (tl.load(x_ptr + base + 2 * C + cols, mask=ok, other=0.0).to(tl.float32) - mean) * rstd
        d0 = tl.load(dy_ptr + base + cols, mask=ok, other=0.0).to(tl.float32)
        d1 = tl.load(dy_ptr + base + C + cols, mask=ok, other=0.0).to(tl.float32)
        d2 = tl.load(dy_ptr + base + 2 * C + cols, mask=ok, other=0.0).to(tl.float32)
        g0, g1, g2 = d0 * s0, d1 * s1, d2 * s2
        c1 = tl.div_rn(tl.sum((g0 * x0 + g1 * x1) + g2 * x2, axis=0), d_float)
        c2 = tl.div_rn(tl.sum((g0 + g1) + g2, axis=0), d_float)
        dt = dx_ptr.dtype.element_ty
        tl.store(dx_ptr + base + cols, (((g0 - c2) - x0 * c1) * rstd).to(dt), mask=ok)
        tl.store(dx_ptr + base + C + cols, (((g1 - c2) - x1 * c1) * rstd).to(dt), mask=ok)
        tl.store(dx_ptr + base + 2 * C + cols, (((g2 - c2) - x2 * c1) * rstd).to(dt), mask=ok)
        a0, a1, a2 = a0 + d0 * x0, a1 + d1 * x1, a2 + d2 * x2
        b0, b1, b2 = b0 + d0, b1 + d1, b2 + d2
    pp = part_ptr + p.to(tl.int64) * (6 * C)
    tl.store(pp + cols, a0)
    tl.store(pp + C + cols, a1)
    tl.store(pp + 2 * C + cols, a2)
    tl.store(pp + 3 * C + cols, b0)
    tl.store(pp + 4 * C + cols, b1)
    tl.store(pp + 5 * C + cols, b2)


def ln3_bwd(dy, x, scale, mean, rstd, warps: int):
    """(dx, [d_scale | d_shift] (1, 6144)) through the product's chunk table and fold (CHUNK_ROWS rows a program)."""
    from mmdit_strict.kernels.triton import segments as seg

    m, d = x.shape
    ch = seg.chunks((m,), x.device)
    dx = torch.empty_like(x)
    part = torch.empty((ch.n, 2 * d), dtype=torch.float32, device=x.device)
    _ln3_bwd_kernel[(ch.n,)](x, scale, dy, mean, rstd, dx, part, m, float(d), ROWS=seg.CHUNK_ROWS, C=C,
                             num_warps=warps, enable_fp_fusion=False)
    return dx, seg.per_sample_sums(part, ch, x.dtype, False)


@triton.jit
def _ln3_fwd_table_kernel(x_ptr, shift_ptr, scale_ptr, y_ptr, rows_ptr, samples_ptr, d_float, eps,
                          C: tl.constexpr, ROW_FROM_TABLE: tl.constexpr):
    """One row a program, as the product's one-row launch: the sample's vectors through a per-row sample table.
    ROW_FROM_TABLE: the row too comes from a table load (the product's chunk table: every x address waits for
    it); otherwise the row is the program id and only the vectors wait for the sample load."""
    p = tl.program_id(0)
    row = tl.load(rows_ptr + p) if ROW_FROM_TABLE else p
    s = tl.load(samples_ptr + p).to(tl.int64)
    cols = tl.arange(0, C)
    base = row.to(tl.int64) * (3 * C)
    x0 = tl.load(x_ptr + base + cols).to(tl.float32)
    x1 = tl.load(x_ptr + base + C + cols).to(tl.float32)
    x2 = tl.load(x_ptr + base + 2 * C + cols).to(tl.float32)
    sc = scale_ptr + s * (3 * C)
    sh = shift_ptr + s * (3 * C)
    mean = tl.div_rn(tl.sum((x0 + x1) + x2, axis=0), d_float)
    c0, c1, c2 = x0 - mean, x1 - mean, x2 - mean
    var = tl.div_rn(tl.sum((c0 * c0 + c1 * c1) + c2 * c2, axis=0), d_float)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    dt = y_ptr.dtype.element_ty
    tl.store(y_ptr + base + cols, ((c0 * rstd) * (1.0 + tl.load(sc + cols).to(tl.float32)) + tl.load(sh + cols).to(tl.float32)).to(dt))
    tl.store(y_ptr + base + C + cols, ((c1 * rstd) * (1.0 + tl.load(sc + C + cols).to(tl.float32))
                                       + tl.load(sh + C + cols).to(tl.float32)).to(dt))
    tl.store(y_ptr + base + 2 * C + cols, ((c2 * rstd) * (1.0 + tl.load(sc + 2 * C + cols).to(tl.float32))
                                           + tl.load(sh + 2 * C + cols).to(tl.float32)).to(dt))


def ln3_fwd_table(x, shift, scale, rows_t, samples_t, row_from_table: bool) -> torch.Tensor:
    m, d = x.shape
    y = torch.empty_like(x)
    _ln3_fwd_table_kernel[(m,)](x, shift, scale, y, rows_t, samples_t, float(d), 1e-6, C=C, ROW_FROM_TABLE=row_from_table,
                                num_warps=4, enable_fp_fusion=False)
    return y


def table_main(out: str) -> None:
    """Does the product's dependent chunk-table load explain its gap to the probe? bf16, one sample."""
    from mmdit_strict.kernels.triton import norms as N

    rows_out = []
    dt = torch.bfloat16
    for m in (4096, 6889):
        x = torch.randn(m, 3 * C, device="cuda", dtype=dt)
        sh, sc = 0.5 * torch.randn(1, 3 * C, device="cuda", dtype=dt), 0.5 * torch.randn(1, 3 * C, device="cuda", dtype=dt)
        rows_t = torch.arange(m, device="cuda", dtype=torch.int32)
        samples_t = torch.zeros(m, device="cuda", dtype=torch.int32)
        nb = 2 * m * 3 * C * 2
        copy = copy_reference(nb).best
        y_prod = N.adaln_modulation_fwd(x, sh, sc, (m,), 1e-6, False)[0]
        cases = (("product (thirds, chunk table, 1 row a program)", lambda: N.adaln_modulation_fwd(x, sh, sc, (m,), 1e-6, False)),
                 ("probe, row = program id, no table", lambda: ln3_fwd(x, sh, sc, 1, 4)),
                 ("probe, row from a table load", lambda: ln3_fwd_table(x, sh, sc, rows_t, samples_t, True)),
                 ("probe, row = program id, sample from a table load", lambda: ln3_fwd_table(x, sh, sc, rows_t, samples_t, False)))
        for label, fn in cases:
            y = fn()
            y = y[0] if isinstance(y, tuple) else y  # the product returns (y, mean, rstd)
            ms = graph_ms(fn, rep=40)
            rows_out.append({"kernel": label, "dtype": str(dt), "rows": m, "ms": ms, "fraction": nb / (ms * 1e-3) / 1e9 / copy,
                             "bytes_equal_product": _same_bytes([y], [y_prod])})
            print(rows_out[-1], flush=True)
    dump(out, rows_out)


def ln3_fwd(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, rows: int, warps: int) -> torch.Tensor:
    m, d = x.shape
    assert d == 3 * C and x.is_contiguous()
    y = torch.empty_like(x)
    _ln3_fwd_kernel[(triton.cdiv(m, rows),)](x, shift, scale, y, m, float(d), 1e-6, ROWS=rows, C=C,
                                             num_warps=warps, enable_fp_fusion=False)
    return y


def _fp64(x, shift, scale):
    x = x.double()
    mean = x.mean(1, keepdim=True)
    var = ((x - mean) ** 2).mean(1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-6) * (1 + scale.double()) + shift.double()


def main(out: str) -> None:
    from mmdit_strict.kernels.triton import norms as N

    rows_out = []
    for dt in (torch.bfloat16, torch.float32):
        es = torch.empty((), dtype=dt).element_size()
        for m in (4096, 6889):
            x = torch.randn(m, 3 * C, device="cuda", dtype=dt)
            sh, sc = 0.5 * torch.randn(1, 3 * C, device="cuda", dtype=dt), 0.5 * torch.randn(1, 3 * C, device="cuda", dtype=dt)
            nb = 2 * m * 3 * C * es
            ref = _fp64(x, sh, sc)
            scale_ref = float(ref.abs().max())
            copy = copy_reference(nb).best
            prod = lambda: N.adaln_modulation_fwd(x, sh, sc, (m,), 1e-6, False)  # noqa: E731
            y_prod = prod()[0]
            ms = graph_ms(prod, rep=40)
            rows_out.append({"kernel": "product (4096-lane tile)", "dtype": str(dt), "rows": m, "ms": ms,
                             "fraction": nb / (ms * 1e-3) / 1e9 / copy,
                             "max_abs_err_over_max_ref": float((y_prod.double() - ref).abs().max()) / scale_ref})
            print(rows_out[-1], flush=True)
            for warps in (4, 8):
                for rows in (1, 2, 4):
                    fn = lambda: ln3_fwd(x, sh, sc, rows, warps)  # noqa: E731
                    y = fn()
                    ms = graph_ms(fn, rep=40)
                    rows_out.append({"kernel": f"3 x {C} chunks, {warps} warps, {rows} rows/program", "dtype": str(dt),
                                     "rows": m, "ms": ms, "fraction": nb / (ms * 1e-3) / 1e9 / copy,
                                     "max_abs_err_over_max_ref": float((y.double() - ref).abs().max()) / scale_ref,
                                     "bytes_equal_product": _same_bytes([y], [y_prod])})
                    print(rows_out[-1], flush=True)
        for m in (4096, 6889):
            x = torch.randn(m, 3 * C, device="cuda", dtype=dt)
            gy = torch.randn(m, 3 * C, device="cuda", dtype=dt)
            sc = 0.5 * torch.randn(1, 3 * C, device="cuda", dtype=dt)
            _, mean, rstd = N.adaln_modulation_fwd(x, torch.zeros_like(sc), sc, (m,), 1e-6, True)
            nb = 3 * m * 3 * C * es
            copy = copy_reference(nb).best
            xd, gd, sd = x.double(), gy.double(), sc.double()
            mu = xd.mean(1, keepdim=True)
            r = 1 / torch.sqrt(((xd - mu) ** 2).mean(1, keepdim=True) + 1e-6)
            xh, g = (xd - mu) * r, gd * (1 + sd)
            dx_ref = r * (g - g.mean(1, keepdim=True) - xh * (g * xh).mean(1, keepdim=True))
            prod_dx, prod_shift, prod_scale = N.adaln_modulation_bwd(gy, x, sc, mean, rstd, (m,), True)
            prod_vec = torch.cat([prod_scale, prod_shift], dim=1)
            for label, fn in (("product bwd (with d_scale/d_shift)", lambda: N.adaln_modulation_bwd(gy, x, sc, mean, rstd, (m,), True)),
                              ("product bwd (dx only: no partials, no fold)", lambda: N.adaln_modulation_bwd(gy, x, sc, mean, rstd, (m,), False))):
                ms = graph_ms(fn, rep=40)
                rows_out.append({"kernel": label, "dtype": str(dt), "rows": m, "ms": ms, "fraction": nb / (ms * 1e-3) / 1e9 / copy,
                                 "dx_max_abs_err_over_max_ref": float((prod_dx.double() - dx_ref).abs().max()) / float(dx_ref.abs().max())})
                print(rows_out[-1], flush=True)
            for warps in (4, 8):
                fn = lambda: ln3_bwd(gy, x, sc, mean, rstd, warps)  # noqa: E731
                dx, vec = fn()
                ms = graph_ms(fn, rep=40)
                rows_out.append({"kernel": f"bwd 3 x {C} chunks, {warps} warps (with d_scale/d_shift)", "dtype": str(dt), "rows": m,
                                 "ms": ms, "fraction": nb / (ms * 1e-3) / 1e9 / copy,
                                 "dx_max_abs_err_over_max_ref": float((dx.double() - dx_ref).abs().max()) / float(dx_ref.abs().max()),
                                 "vec_bytes_equal_product": _same_bytes([vec], [prod_vec])})
                print(rows_out[-1], flush=True)
    dump(out, rows_out)


if __name__ == "__main__":
    table_main(sys.argv[2]) if sys.argv[1] == "--table" else main(sys.argv[1])

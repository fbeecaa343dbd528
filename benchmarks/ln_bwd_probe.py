"""Probe: the LayerNorm-modulation backward with several rows a step, and with programmatic dependent launch.

The product backward (``kernels/triton/norms.py``) gives each program one 16-row chunk and walks it a row at a
time (the chain of d_scale / d_shift partials), so 4096 rows are 256 programs of 8 warps, about two per SM, and
every row pays two cross-warp reductions before the next can start. Its partials then go through a second kernel
(the per-sample fold), whose launch and ramp the GPU serialises behind the first. This probe measures two
candidate changes before any product change:

* **rows a step** (R): the chunk's rows handled R at a time as (R, 1024) tiles, the partials kept as R
  interleaved column chains and added by one ``tl.sum`` over R at the end (**other vector bytes**: a new tree);
  chunks of CH rows (16 or 32: 32 halves the partials and the fold's work);
* **programmatic dependent launch** (PDL, ``launch_pdl=True`` with ``gdc_wait`` / ``gdc_launch_dependents``):
  the fold is launched while the backward runs and waits on the device; the arithmetic is untouched.

Each variant is timed (CUDA-graph replay) beside the product and the copy of the same bytes (x, dy read; dx
written), bf16 and fp32, 4096 and 6889 rows; dx and the vectors are compared with the product's bytes and dx's
error with an FP64 reference.

GPU:        python -m benchmarks.ln_bwd_probe OUT.json
Interpreter check of the kernels' logic (tiny shapes, FP32, no PDL): TRITON_INTERPRET=1 python -m benchmarks.ln_bwd_probe --check
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

W = 1024  # lanes a third: the 3072 row as three full tiles


@triton.jit
def _gdc_wait(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _gdc_launch(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _ln_bwd_tiles_kernel(x_ptr, scale_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr, M, d_float,
                         CH: tl.constexpr, R: tl.constexpr, W: tl.constexpr, NEED_VEC: tl.constexpr, PDL: tl.constexpr):
    """Rows [p·CH, p·CH + CH) of one sample, R at a time as (R, W) tiles of each third: dx as the product (row
    sums over the thirds lane by lane, then tl.sum); partials part[p] = Σ over the R chains (tl.sum over R) of
    each chain's rows in order."""
    _gdc_wait(PDL)  # every input may come from the kernel before
    _gdc_launch(PDL)
    p = tl.program_id(0)
    cols = tl.arange(0, W)[None, :]
    rr = tl.arange(0, R)[:, None]
    a0 = 1.0 + tl.load(scale_ptr + cols).to(tl.float32)
    a1 = 1.0 + tl.load(scale_ptr + W + cols).to(tl.float32)
    a2 = 1.0 + tl.load(scale_ptr + 2 * W + cols).to(tl.float32)
    ps0 = tl.zeros((R, W), tl.float32)
    ps1 = tl.zeros((R, W), tl.float32)
    ps2 = tl.zeros((R, W), tl.float32)
    pb0 = tl.zeros((R, W), tl.float32)
    pb1 = tl.zeros((R, W), tl.float32)
    pb2 = tl.zeros((R, W), tl.float32)
    for i in range(0, CH, R):
        row = p * CH + i + rr
        rok = row < M
        ok = rok & (cols < W)
        base = row.to(tl.int64) * (3 * W)
        mean = tl.load(mean_ptr + row, mask=rok, other=0.0)
        rstd = tl.load(rstd_ptr + row, mask=rok, other=0.0)
        h0 = (tl.load(x_ptr + base + cols, mask=ok, other=0.0).to(tl.float32) - mean) * rstd
        h1 = (tl.load(x_ptr + base + W + cols, mask=ok, other=0.0).to(tl.float32) - mean) * rstd
        h2 = (tl.load(x_ptr + base + 2 * W + cols, mask=ok, other=0.0).to(tl.float32) - mean) * rstd
        e0 = tl.load(dy_ptr + base + cols, mask=ok, other=0.0).to(tl.float32)
        e1 = tl.load(dy_ptr + base + W + cols, mask=ok, other=0.0).to(tl.float32)
        e2 = tl.load(dy_ptr + base + 2 * W + cols, mask=ok, other=0.0).to(tl.float32)
        g0, g1, g2 = e0 * a0, e1 * a1, e2 * a2
        c1 = tl.div_rn(tl.sum((g0 * h0 + g1 * h1) + g2 * h2, axis=1), d_float)[:, None]
        c2 = tl.div_rn(tl.sum((g0 + g1) + g2, axis=1), d_float)[:, None]
        dt = dx_ptr.dtype.element_ty
        tl.store(dx_ptr + base + cols, (((g0 - c2) - h0 * c1) * rstd).to(dt), mask=ok)
        tl.store(dx_ptr + base + W + cols, (((g1 - c2) - h1 * c1) * rstd).to(dt), mask=ok)
        tl.store(dx_ptr + base + 2 * W + cols, (((g2 - c2) - h2 * c1) * rstd).to(dt), mask=ok)
        if NEED_VEC:
            ps0, ps1, ps2 = ps0 + e0 * h0, ps1 + e1 * h1, ps2 + e2 * h2
            pb0, pb1, pb2 = pb0 + e0, pb1 + e1, pb2 + e2
    if NEED_VEC:
        c = tl.arange(0, W)
        pp = part_ptr + p.to(tl.int64) * (6 * W)
        tl.store(pp + c, tl.sum(ps0, axis=0))
        tl.store(pp + W + c, tl.sum(ps1, axis=0))
        tl.store(pp + 2 * W + c, tl.sum(ps2, axis=0))
        tl.store(pp + 3 * W + c, tl.sum(pb0, axis=0))
        tl.store(pp + 4 * W + c, tl.sum(pb1, axis=0))
        tl.store(pp + 5 * W + c, tl.sum(pb2, axis=0))


@triton.jit
def _fold_kernel(part_ptr, out_ptr, n_chunks, N, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """out[cols] = the product's level-2 fold of one sample's chunk partials (tiles of BLOCK_C, tl.sum, chained)."""
    _gdc_wait(PDL)
    _gdc_launch(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < N
    offs = tl.arange(0, BLOCK_C)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for t0 in range(0, n_chunks, BLOCK_C):
        rows = t0 + offs
        tile = tl.load(part_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
                       mask=(rows < n_chunks)[:, None] & mask_n[None, :], other=0.0)
        acc = acc + tl.sum(tile, axis=0)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def probe_bwd(dy, x, scale, mean, rstd, ch_rows: int, r: int, warps: int, need_vec: bool, pdl: bool):
    """(dx, [d_scale | d_shift] (1, 2D) or None) of one sample through the probe kernels."""
    m, d = x.shape
    assert d == 3 * W and x.is_contiguous() and dy.is_contiguous()
    n = triton.cdiv(m, ch_rows)
    dx = torch.empty_like(x)
    part = torch.empty((n, 2 * d), dtype=torch.float32, device=x.device) if need_vec else dx
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    opts = {} if interp else {"num_warps": warps, "enable_fp_fusion": False, "launch_pdl": pdl}
    _ln_bwd_tiles_kernel[(n,)](x, scale, dy, mean, rstd, dx, part, m, float(d), CH=ch_rows, R=r, W=W,
                               NEED_VEC=need_vec, PDL=pdl, **opts)
    if not need_vec:
        return dx, None
    vec = torch.empty((1, 2 * d), dtype=x.dtype, device=x.device)
    fopts = {} if interp else {"num_warps": 4, "enable_fp_fusion": False, "launch_pdl": pdl}
    _fold_kernel[(triton.cdiv(2 * d, 16),)](part, vec, n, 2 * d, BLOCK_C=64, BLOCK_N=16, PDL=pdl, **fopts)
    return dx, vec


def _reference(dy, x, scale):
    xd, gd, sd = x.double(), dy.double(), scale.double()
    mu = xd.mean(1, keepdim=True)
    r = 1 / torch.sqrt(((xd - mu) ** 2).mean(1, keepdim=True) + 1e-6)
    xh, g = (xd - mu) * r, gd * (1 + sd)
    dx = r * (g - g.mean(1, keepdim=True) - xh * (g * xh).mean(1, keepdim=True))
    return dx, torch.cat([(gd * xh).sum(0, keepdim=True), gd.sum(0, keepdim=True)], dim=1)


def _inputs(m: int, dt: torch.dtype, device: str):
    from mmdit_strict.kernels.triton import norms as N

    g = torch.Generator(device="cpu").manual_seed(m)
    x = torch.randn(m, 3 * W, generator=g).to(device=device, dtype=dt)
    dy = torch.randn(m, 3 * W, generator=g).to(device=device, dtype=dt)
    sc = (0.5 * torch.randn(1, 3 * W, generator=g)).to(device=device, dtype=dt)
    _, mean, rstd = N.adaln_modulation_fwd(x, torch.zeros_like(sc), sc, (m,), 1e-6, True)
    return x, dy, sc, mean, rstd


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).abs().max()) / float(ref.abs().max())


def check() -> None:
    """Interpreter: each variant's dx and vectors against FP64 at a tiny row count (not a multiple of CH)."""
    from mmdit_strict.kernels.triton import norms as N

    m = 37
    x, dy, sc, mean, rstd = _inputs(m, torch.float32, "cpu")
    dx_ref, vec_ref = _reference(dy, x, sc)
    pdx, psh, psc = N.adaln_modulation_bwd(dy, x, sc, mean, rstd, (m,), True)
    for ch_rows, r in ((16, 1), (16, 2), (32, 4)):
        dx, vec = probe_bwd(dy, x, sc, mean, rstd, ch_rows, r, 8, True, False)
        print(f"CH {ch_rows} R {r}: dx err {_err(dx, dx_ref):.2e}, vec err {_err(vec, vec_ref):.2e}, "
              f"dx bytes = product: {torch.equal(dx.view(torch.int32), pdx.view(torch.int32))}")
        assert _err(dx, dx_ref) < 1e-5 and _err(vec, vec_ref) < 1e-5


VARIANTS = ((16, 1, 8), (16, 2, 8), (16, 2, 16), (16, 4, 16), (32, 2, 8), (32, 4, 8), (32, 4, 16), (64, 4, 16))


def main(out: str) -> None:
    from mmdit_strict.bench.bandwidth import copy_reference
    from mmdit_strict.bench.timing import graph_ms
    from mmdit_strict.kernels.triton import norms as N

    from .copy_probe import dump

    rows_out = []

    def same(a, b) -> bool:
        w = {4: torch.int32, 2: torch.int16}[a.element_size()]
        return torch.equal(a.contiguous().view(w), b.contiguous().view(w))

    for dt in (torch.bfloat16, torch.float32):
        es = torch.empty((), dtype=dt).element_size()
        for m in (4096, 6889):
            x, dy, sc, mean, rstd = _inputs(m, dt, "cuda")
            nb = 3 * m * 3 * W * es
            copy = copy_reference(nb).best
            dx_ref, vec_ref = _reference(dy, x, sc)
            pdx, psh, psc = N.adaln_modulation_bwd(dy, x, sc, mean, rstd, (m,), True)
            pvec = torch.cat([psc, psh], dim=1)

            def record(label, fn, dx, vec):
                ms = graph_ms(fn, rep=40)
                row = {"kernel": label, "dtype": str(dt), "rows": m, "ms": ms,
                       "fraction": nb / (ms * 1e-3) / 1e9 / copy if ms else None,
                       "dx_err": _err(dx, dx_ref), "dx_bytes_equal_product": same(dx, pdx)}
                if vec is not None:
                    row |= {"vec_err": _err(vec, vec_ref), "vec_bytes_equal_product": same(vec, pvec)}
                rows_out.append(row)
                print(row, flush=True)

            record("product (with d_scale/d_shift)", lambda: N.adaln_modulation_bwd(dy, x, sc, mean, rstd, (m,), True), pdx, pvec)
            record("product dx only", lambda: N.adaln_modulation_bwd(dy, x, sc, mean, rstd, (m,), False), pdx, None)
            for ch_rows, r, warps in VARIANTS:
                for pdl in (False, True):
                    try:
                        for _ in range(20):  # back to back: with PDL each launch overlaps the one before
                            dx, vec = probe_bwd(dy, x, sc, mean, rstd, ch_rows, r, warps, True, pdl)
                        record(f"CH {ch_rows}, R {r}, {warps} warps, pdl {int(pdl)}",
                               lambda: probe_bwd(dy, x, sc, mean, rstd, ch_rows, r, warps, True, pdl), dx, vec)
                    except Exception as e:  # noqa: BLE001 - a variant that does not compile or launch is reported
                        rows_out.append({"kernel": f"CH {ch_rows}, R {r}, {warps} warps, pdl {int(pdl)}", "dtype": str(dt),
                                         "rows": m, "error": repr(e)[:300]})
                        print(rows_out[-1], flush=True)
            for r, warps in ((1, 8), (2, 8), (2, 16)):
                dx, _ = probe_bwd(dy, x, sc, mean, rstd, 16, r, warps, False, False)
                record(f"dx only, R {r}, {warps} warps", lambda: probe_bwd(dy, x, sc, mean, rstd, 16, r, warps, False, False), dx, None)
            del x, dy, mean, rstd, dx_ref
            torch.cuda.empty_cache()
    dump(out, rows_out)


if __name__ == "__main__":
    check() if sys.argv[1] == "--check" else main(sys.argv[1])

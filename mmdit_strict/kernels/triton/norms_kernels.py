"""Kernels of the strict modulation operators (Triton): AdaLN modulation (LayerNorm), gated residual.

Contract, arithmetic and reduction trees: :mod:`.norms` (the host side: launch configuration table, launchers,
autograd, registry). The per-sample sums (d_scale, d_shift, d_gate) are written as chunk partials here and folded
by :mod:`.segments`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _layer_norm_row(x, mask, d_float, eps):
    """(mean, rstd, x̂) of one FP32 row (masked lanes of x are 0): Σ by tl.sum, ⊘ and √ correctly rounded."""
    mean = tl.div_rn(tl.sum(x, axis=0), d_float)
    xc = tl.where(mask, x - mean, 0.0)
    var = tl.div_rn(tl.sum(xc * xc, axis=0), d_float)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    return mean, rstd, xc * rstd


@triton.jit
def _layer_norm_thirds(x0, x1, x2, d_float, eps):
    """(mean, rstd, x̂ of each third) of one FP32 row held as three full tiles (no masked lane). Each Σ adds
    the thirds lane by lane, ``(t0 + t1) + t2``, then reduces that one tile with tl.sum."""
    mean = tl.div_rn(tl.sum((x0 + x1) + x2, axis=0), d_float)
    c0, c1, c2 = x0 - mean, x1 - mean, x2 - mean
    var = tl.div_rn(tl.sum((c0 * c0 + c1 * c1) + c2 * c2, axis=0), d_float)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    return mean, rstd, c0 * rstd, c1 * rstd, c2 * rstd


@triton.jit
def _program_chunk(table_ptr, n_chunks):
    """This program's chunk of a :class:`.segments.Chunks` table: (c, first row, end row, sample as int64)."""
    c = tl.program_id(0)
    r0 = tl.load(table_ptr + c)
    r1 = tl.load(table_ptr + n_chunks + c)
    s = tl.load(table_ptr + 2 * n_chunks + c).to(tl.int64)
    return c, r0, r1, s


@triton.jit
def _sample_vector(v_ptr, s, stride_v, cols, mask):
    """Sample s's row of a per-sample (B, D) vector in FP32 (masked lanes 0)."""
    return tl.load(v_ptr + s * stride_v + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_scale_shift_partials(part_ptr, c, stride_part, D, cols, mask, p_scale, p_shift):
    """Chunk c's partial row: part[c, :D] = the scale partials, part[c, D:] = the shift partials."""
    base = part_ptr + c.to(tl.int64) * stride_part
    tl.store(base + cols, p_scale, mask=mask)
    tl.store(base + D + cols, p_shift, mask=mask)


@triton.jit
def _adaln_mod_fwd_kernel(
    x_ptr, shift_ptr, scale_ptr, table_ptr, y_ptr, mean_ptr, rstd_ptr,
    n_chunks, D, d_float, eps, stride_x, stride_y, stride_shift, stride_scale,
    STORE_STATS: tl.constexpr, AHEAD: tl.constexpr, STAGES: tl.constexpr, BLOCK_D: tl.constexpr,
    THIRDS: tl.constexpr = False, ONE_ROW: tl.constexpr = False,
):
    """y = x̂·(1 + scale[s]) + shift[s] for the rows of one chunk (all of sample s); one cast at the store.
    AHEAD: row r+1 is read (in the storage dtype) before row r is reduced; nothing past the chunk is read.
    STAGES (None or 2..8): the row loop pipelined through shared memory. The row's arithmetic is the same
    either way. THIRDS (D = 3·BLOCK_D): the row as three BLOCK_D-lane tiles (:func:`_adaln_mod_fwd_thirds`)."""
    if THIRDS and ONE_ROW:
        _adaln_mod_fwd_thirds_row(x_ptr, shift_ptr, scale_ptr, y_ptr, mean_ptr, rstd_ptr, table_ptr, n_chunks, d_float,
                                  eps, stride_x, stride_y, stride_shift, stride_scale, STORE_STATS, BLOCK_D)
    elif THIRDS:
        _, r0, r1, s = _program_chunk(table_ptr, n_chunks)
        _adaln_mod_fwd_thirds(x_ptr, shift_ptr, scale_ptr, y_ptr, mean_ptr, rstd_ptr, r0, r1, s, d_float, eps,
                              stride_x, stride_y, stride_shift, stride_scale, STORE_STATS, AHEAD, STAGES, BLOCK_D)
    else:
        _, r0, r1, s = _program_chunk(table_ptr, n_chunks)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        first = r0.to(tl.int64)
        if AHEAD:
            x_cur = tl.load(x_ptr + first * stride_x + cols, mask=mask, other=0.0)  # a chunk has >= 1 row
        scale1 = 1.0 + _sample_vector(scale_ptr, s, stride_scale, cols, mask)
        shift = _sample_vector(shift_ptr, s, stride_shift, cols, mask)
        for i in tl.range(0, r1 - r0, num_stages=STAGES):
            row = first + i
            if AHEAD:
                nxt = row + 1
                x_nxt = tl.load(x_ptr + nxt * stride_x + cols, mask=cols < tl.where(nxt < r1, D, 0), other=0.0)
                x = x_cur.to(tl.float32)
            else:
                x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            mean, rstd, xhat = _layer_norm_row(x, mask, d_float, eps)
            y = xhat * scale1 + shift
            tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
            if STORE_STATS:
                tl.store(mean_ptr + row, mean)
                tl.store(rstd_ptr + row, rstd)
            if AHEAD:
                x_cur = x_nxt


@triton.jit
def _load_thirds(ptr, cols, W: tl.constexpr):
    """The three W-lane thirds of one row (storage dtype)."""
    return tl.load(ptr + cols), tl.load(ptr + W + cols), tl.load(ptr + 2 * W + cols)


@triton.jit
def _load_thirds_if(ptr, cols, W: tl.constexpr, ok):
    """:func:`_load_thirds` where ``ok`` (zeros where it is False: the read-ahead past a chunk's last row)."""
    return (tl.load(ptr + cols, mask=ok, other=0.0), tl.load(ptr + W + cols, mask=ok, other=0.0),
            tl.load(ptr + 2 * W + cols, mask=ok, other=0.0))


@triton.jit
def _store_thirds(ptr, cols, W: tl.constexpr, t0, t1, t2):
    """Store three W-lane tiles as one row (the counterpart of :func:`_load_thirds`)."""
    tl.store(ptr + cols, t0)
    tl.store(ptr + W + cols, t1)
    tl.store(ptr + 2 * W + cols, t2)


@triton.jit
def _adaln_mod_fwd_thirds_row(x_ptr, shift_ptr, scale_ptr, y_ptr, mean_ptr, rstd_ptr, table_ptr, n_chunks, d_float, eps,
                              stride_x, stride_y, stride_shift, stride_scale, STORE_STATS: tl.constexpr, W: tl.constexpr):
    """:func:`_adaln_mod_fwd_thirds` for one-row chunks (launch fwd_rows 1, no read-ahead, no stages): chunk c is
    row c (chunks are cut per sample from its first row and samples are packed in order), so the row's loads do
    not wait for the chunk table; only the per-sample vectors wait for the sample index. Same arithmetic."""
    c = tl.program_id(0)
    row = c.to(tl.int64)
    cols = tl.arange(0, W)
    x0, x1, x2 = _load_thirds(x_ptr + row * stride_x, cols, W)
    s = tl.load(table_ptr + 2 * n_chunks + c).to(tl.int64)
    mean, rstd, h0, h1, h2 = _layer_norm_thirds(x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), d_float, eps)
    sc = scale_ptr + s * stride_scale
    sh = shift_ptr + s * stride_shift
    out = y_ptr + row * stride_y
    dt = y_ptr.dtype.element_ty
    _store_thirds(out, cols, W,
                  (h0 * (1.0 + tl.load(sc + cols).to(tl.float32)) + tl.load(sh + cols).to(tl.float32)).to(dt),
                  (h1 * (1.0 + tl.load(sc + W + cols).to(tl.float32)) + tl.load(sh + W + cols).to(tl.float32)).to(dt),
                  (h2 * (1.0 + tl.load(sc + 2 * W + cols).to(tl.float32))
                   + tl.load(sh + 2 * W + cols).to(tl.float32)).to(dt))
    if STORE_STATS:
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)


@triton.jit
def _adaln_mod_fwd_thirds(x_ptr, shift_ptr, scale_ptr, y_ptr, mean_ptr, rstd_ptr, r0, r1, s, d_float, eps,
                          stride_x, stride_y, stride_shift, stride_scale,
                          STORE_STATS: tl.constexpr, AHEAD: tl.constexpr, STAGES: tl.constexpr, W: tl.constexpr):
    """The forward rows r0..r1 of sample s with D = 3·W: each row as three full W-lane tiles, so no lane is masked
    (a 3072-wide row as 3 x 1024 instead of one 4096-lane tile a quarter idle). Tree: :func:`_layer_norm_thirds`."""
    cols = tl.arange(0, W)
    first = r0.to(tl.int64)
    sc = scale_ptr + s * stride_scale
    sh = shift_ptr + s * stride_shift
    a0, a1, a2 = (1.0 + tl.load(sc + cols).to(tl.float32), 1.0 + tl.load(sc + W + cols).to(tl.float32),
                  1.0 + tl.load(sc + 2 * W + cols).to(tl.float32))
    b0, b1, b2 = (tl.load(sh + cols).to(tl.float32), tl.load(sh + W + cols).to(tl.float32),
                  tl.load(sh + 2 * W + cols).to(tl.float32))
    if AHEAD:
        n0, n1, n2 = _load_thirds(x_ptr + first * stride_x, cols, W)  # a chunk has >= 1 row
    for i in tl.range(0, r1 - r0, num_stages=STAGES):
        row = first + i
        if AHEAD:
            x0, x1, x2 = n0, n1, n2
            n0, n1, n2 = _load_thirds_if(x_ptr + (row + 1) * stride_x, cols, W, (cols * 0 + row + 1) < r1)
        else:
            x0, x1, x2 = _load_thirds(x_ptr + row * stride_x, cols, W)
        mean, rstd, h0, h1, h2 = _layer_norm_thirds(x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), d_float, eps)
        out = y_ptr + row * stride_y
        dt = y_ptr.dtype.element_ty
        _store_thirds(out, cols, W, (h0 * a0 + b0).to(dt), (h1 * a1 + b1).to(dt), (h2 * a2 + b2).to(dt))
        if STORE_STATS:
            tl.store(mean_ptr + row, mean)
            tl.store(rstd_ptr + row, rstd)


@triton.jit
def _adaln_mod_bwd_kernel(
    x_ptr, scale_ptr, dy_ptr, mean_ptr, rstd_ptr, table_ptr, dx_ptr, part_ptr,
    n_chunks, D, d_float, stride_x, stride_dy, stride_dx, stride_scale, stride_part,
    NEED_VEC: tl.constexpr, AHEAD: tl.constexpr, STAGES: tl.constexpr, BLOCK_D: tl.constexpr,
    THIRDS: tl.constexpr = False,
):
    """One chunk (≤ CHUNK_ROWS rows of sample s): dx per row, and the chunk's partials
    part[c, :D] = Σ dy·x̂, part[c, D:] = Σ dy chained in row order (FP32). AHEAD: the next row's x, dy,
    mean and rstd are loaded before the current row is reduced (a register double buffer); 0: each row is
    read when it is processed; STAGES (None or 2..8, with AHEAD 0): the row loop pipelined through shared
    memory. No effect on the arithmetic. THIRDS (D = 3·BLOCK_D): :func:`_adaln_mod_bwd_thirds`."""
    c, r0, r1, s = _program_chunk(table_ptr, n_chunks)
    if THIRDS:
        _adaln_mod_bwd_thirds(x_ptr, scale_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr, c, r0, r1, s, D, d_float,
                              stride_x, stride_dy, stride_dx, stride_scale, stride_part, NEED_VEC, AHEAD, STAGES, BLOCK_D)
        return
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    scale1 = 1.0 + _sample_vector(scale_ptr, s, stride_scale, cols, mask)
    p_scale = tl.zeros((BLOCK_D,), dtype=tl.float32)
    p_shift = tl.zeros((BLOCK_D,), dtype=tl.float32)
    first = r0.to(tl.int64)
    if AHEAD:
        x_c = tl.load(x_ptr + first * stride_x + cols, mask=mask, other=0.0)
        dy_c = tl.load(dy_ptr + first * stride_dy + cols, mask=mask, other=0.0)
        mean_c = tl.load(mean_ptr + first)
        rstd_c = tl.load(rstd_ptr + first)
    for i in tl.range(0, r1 - r0, num_stages=STAGES):
        row = first + i
        if AHEAD:
            nxt = row + 1
            nmask = cols < tl.where(nxt < r1, D, 0)  # nothing past the chunk's last row is read
            nclamp = tl.minimum(nxt, r1 - 1)
            x_n = tl.load(x_ptr + nxt * stride_x + cols, mask=nmask, other=0.0)
            dy_n = tl.load(dy_ptr + nxt * stride_dy + cols, mask=nmask, other=0.0)
            mean_n = tl.load(mean_ptr + nclamp)
            rstd_n = tl.load(rstd_ptr + nclamp)
            x, dy, mean, rstd = x_c, dy_c, mean_c, rstd_c
        else:
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
            dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0)
            mean = tl.load(mean_ptr + row)
            rstd = tl.load(rstd_ptr + row)
        xhat = tl.where(mask, x.to(tl.float32) - mean, 0.0) * rstd
        dyf = dy.to(tl.float32)
        g = dyf * scale1
        c1 = tl.div_rn(tl.sum(g * xhat, axis=0), d_float)
        c2 = tl.div_rn(tl.sum(g, axis=0), d_float)
        dx = ((g - c2) - xhat * c1) * rstd
        tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if NEED_VEC:
            p_scale = p_scale + dyf * xhat
            p_shift = p_shift + dyf
        if AHEAD:
            x_c, dy_c, mean_c, rstd_c = x_n, dy_n, mean_n, rstd_n
    if NEED_VEC:
        _store_scale_shift_partials(part_ptr, c, stride_part, D, cols, mask, p_scale, p_shift)


@triton.jit
def _adaln_mod_bwd_thirds(x_ptr, scale_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr, c, r0, r1, s, D, d_float,
                          stride_x, stride_dy, stride_dx, stride_scale, stride_part,
                          NEED_VEC: tl.constexpr, AHEAD: tl.constexpr, STAGES: tl.constexpr, W: tl.constexpr):
    """The backward of chunk c (rows r0..r1 of sample s) with D = 3·W, each row as three full W-lane tiles. The
    row sums Σg·x̂ and Σg add the thirds lane by lane, ``(t0 + t1) + t2``, then tl.sum one tile (the forward's
    tree). The partials are per column, chained in row order as in the one-tile kernel: the same bytes."""
    cols = tl.arange(0, W)
    sc = scale_ptr + s * stride_scale
    a0 = 1.0 + tl.load(sc + cols).to(tl.float32)
    a1 = 1.0 + tl.load(sc + W + cols).to(tl.float32)
    a2 = 1.0 + tl.load(sc + 2 * W + cols).to(tl.float32)
    ps0 = tl.zeros((W,), dtype=tl.float32)
    ps1 = tl.zeros((W,), dtype=tl.float32)
    ps2 = tl.zeros((W,), dtype=tl.float32)
    pb0 = tl.zeros((W,), dtype=tl.float32)
    pb1 = tl.zeros((W,), dtype=tl.float32)
    pb2 = tl.zeros((W,), dtype=tl.float32)
    first = r0.to(tl.int64)
    if AHEAD:  # a chunk has >= 1 row
        xc0, xc1, xc2 = _load_thirds(x_ptr + first * stride_x, cols, W)
        dc0, dc1, dc2 = _load_thirds(dy_ptr + first * stride_dy, cols, W)
        mean_c = tl.load(mean_ptr + first)
        rstd_c = tl.load(rstd_ptr + first)
    for i in tl.range(0, r1 - r0, num_stages=STAGES):
        row = first + i
        if AHEAD:
            nxt = row + 1
            ok = (cols * 0 + nxt) < r1  # nothing past the chunk's last row is read
            nclamp = tl.minimum(nxt, r1 - 1)
            xn0, xn1, xn2 = _load_thirds_if(x_ptr + nxt * stride_x, cols, W, ok)
            dn0, dn1, dn2 = _load_thirds_if(dy_ptr + nxt * stride_dy, cols, W, ok)
            mean_n = tl.load(mean_ptr + nclamp)
            rstd_n = tl.load(rstd_ptr + nclamp)
            x0, x1, x2, d0, d1, d2, mean, rstd = xc0, xc1, xc2, dc0, dc1, dc2, mean_c, rstd_c
        else:
            x0, x1, x2 = _load_thirds(x_ptr + row * stride_x, cols, W)
            d0, d1, d2 = _load_thirds(dy_ptr + row * stride_dy, cols, W)
            mean = tl.load(mean_ptr + row)
            rstd = tl.load(rstd_ptr + row)
        h0 = (x0.to(tl.float32) - mean) * rstd
        h1 = (x1.to(tl.float32) - mean) * rstd
        h2 = (x2.to(tl.float32) - mean) * rstd
        e0, e1, e2 = d0.to(tl.float32), d1.to(tl.float32), d2.to(tl.float32)
        g0, g1, g2 = e0 * a0, e1 * a1, e2 * a2
        c1 = tl.div_rn(tl.sum((g0 * h0 + g1 * h1) + g2 * h2, axis=0), d_float)
        c2 = tl.div_rn(tl.sum((g0 + g1) + g2, axis=0), d_float)
        out = dx_ptr + row * stride_dx
        dt = dx_ptr.dtype.element_ty
        _store_thirds(out, cols, W, (((g0 - c2) - h0 * c1) * rstd).to(dt), (((g1 - c2) - h1 * c1) * rstd).to(dt),
                      (((g2 - c2) - h2 * c1) * rstd).to(dt))
        if NEED_VEC:
            ps0, ps1, ps2 = ps0 + e0 * h0, ps1 + e1 * h1, ps2 + e2 * h2
            pb0, pb1, pb2 = pb0 + e0, pb1 + e1, pb2 + e2
        if AHEAD:
            xc0, xc1, xc2, dc0, dc1, dc2, mean_c, rstd_c = xn0, xn1, xn2, dn0, dn1, dn2, mean_n, rstd_n
    if NEED_VEC:
        base = part_ptr + c.to(tl.int64) * stride_part
        _store_thirds(base, cols, W, ps0, ps1, ps2)
        _store_thirds(base + D, cols, W, pb0, pb1, pb2)


@triton.jit
def _gate_residual_fwd_kernel(
    x_ptr, y_ptr, gate_ptr, table_ptr, out_ptr,
    n_chunks, D, stride_x, stride_y, stride_gate, stride_out,
    BLOCK_D: tl.constexpr,
):
    """out = x + gate[s]·y for the rows of one chunk; one cast at the store."""
    _, r0, r1, s = _program_chunk(table_ptr, n_chunks)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    gate = _sample_vector(gate_ptr, s, stride_gate, cols, mask)
    first = r0.to(tl.int64)
    for i in range(0, r1 - r0):
        row = first + i
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (x + gate * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate_residual_bwd_kernel(
    dout_ptr, y_ptr, gate_ptr, table_ptr, dy_ptr, part_ptr,
    n_chunks, D, stride_dout, stride_y, stride_gate, stride_dy, stride_part,
    NEED_DY: tl.constexpr, NEED_VEC: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Columns [j·BLOCK_D, (j+1)·BLOCK_D) (j = program_id(1)) of one chunk of sample s: dy = dout·gate[s] per row;
    part[c, cols] = Σ dout·y chained in row order (FP32), one row read ahead. No sum crosses columns, so how the
    columns are split between programs changes no byte (:data:`.norms.GATE_BWD_COLS`)."""
    c, r0, r1, s = _program_chunk(table_ptr, n_chunks)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    gate = _sample_vector(gate_ptr, s, stride_gate, cols, mask)
    p = tl.zeros((BLOCK_D,), dtype=tl.float32)
    ylim = D
    if not NEED_VEC:  # y is read only for the gate's partials
        ylim = 0
    ymask = cols < ylim
    first = r0.to(tl.int64)
    dout = tl.load(dout_ptr + first * stride_dout + cols, mask=mask, other=0.0)  # a chunk has >= 1 row
    y = tl.load(y_ptr + first * stride_y + cols, mask=ymask, other=0.0)
    for i in range(0, r1 - r0):
        row = first + i
        nxt = row + 1
        has = nxt < r1
        dout_n = tl.load(dout_ptr + nxt * stride_dout + cols, mask=cols < tl.where(has, D, 0), other=0.0)
        y_n = tl.load(y_ptr + nxt * stride_y + cols, mask=cols < tl.where(has, ylim, 0), other=0.0)
        df = dout.to(tl.float32)
        if NEED_DY:
            tl.store(dy_ptr + row * stride_dy + cols, (df * gate).to(dy_ptr.dtype.element_ty), mask=mask)
        if NEED_VEC:
            p = p + df * y.to(tl.float32)
        dout, y = dout_n, y_n
    if NEED_VEC:
        tl.store(part_ptr + c.to(tl.int64) * stride_part + cols, p, mask=mask)

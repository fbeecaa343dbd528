"""CUDA strict modulation operators (``kernels/triton/norms.py``): adaln_modulation, adaln_gate_residual,
final_adaln_out, txt_in_rmsnorm_linear.

Without CUDA the kernels run under ``TRITON_INTERPRET=1`` (FP32, tiny widths, CI); with CUDA the
``@pytest.mark.gpu`` tests run Qwen-Image's widths (D = 3072, Ct = 3584) in bf16 and fp32
(``python -m pytest -m gpu tests/kernels/test_triton_norms.py``). Accuracy bounds: ``tolerances.yaml``
``row_ops.*`` (``atol_max``: a fraction of the tensor's max|ref|). Byte claims: tests/harness.py.
"""

from __future__ import annotations

import pytest
import triton
import torch

from tests.kernels.triton_rows import GPU_TARGETS, INTERPRET, N, R, S, interp, on_gpu_targets, skip_unless_compiled  # noqa: I001  (interpreter mode: tests/conftest.py)

from mmdit_strict.bench.norms import row_tolerance  # noqa: E402
from mmdit_strict.kernels import production as P  # noqa: E402
from mmdit_strict.reference import ops as ref  # noqa: E402
from benchmarks import row_launches as L  # noqa: E402
from tests.harness import (  # noqa: E402
    CPU_FP32,
    BadCase,
    Target,
    assert_bytes_equal,
    check_bad_inputs,
    check_grad_accuracy,
    check_param_grad_fold,
    check_row_invariance,
    check_token_sweep,
    generator,
    packed_op,
    randn,
    run_with_grads,
    run_without_host_sync,
)

EPS = 1e-6
D = 40  # interpreter width: not a power of two
SEQ = (5, 0, 19, 33)  # an empty sample, chunks of 16 rows crossed


# ------------------------------------------------------------------------------------------------
# shared checks (interpreter and GPU run the same code at different widths)
# ------------------------------------------------------------------------------------------------


def _vec(b: int, d: int, gen, target: Target) -> torch.Tensor:
    return randn(b, d, gen=gen, target=target, scale=0.5)


def accuracy(fn, ref_fn, inputs, wrt, check, target, what, kwargs=None, peer_fn=None):
    """Forward and each gradient in ``wrt`` vs the FP64 reference, each bounded by row_ops.<check>[_grad]
    scaled by that tensor's max|ref|."""
    kwargs = kwargs or {}
    dev = [target.put(t) if isinstance(t, torch.Tensor) else t for t in inputs]
    with torch.no_grad():
        probe = fn(*dev, **kwargs)
    gy = randn(*probe.shape, gen=generator(77), target=target)
    ref_in = [t.detach().to("cpu", torch.float64) if isinstance(t, torch.Tensor) else t for t in dev]
    ref_out, ref_grads = run_with_grads(ref_fn, ref_in, gy.detach().to("cpu", torch.float64), wrt, **kwargs)
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[target.dtype]
    for i in wrt:
        tol = {"fwd": row_tolerance(check, name, ref_out), "grad": row_tolerance(f"{check}_grad", name, ref_grads[i])}
        check_grad_accuracy(fn, ref_fn, inputs, tol, target=target, grad_out=gy, wrt=[i], peer_fn=peer_fn,
                            what=f"{what} {target.label} grad {i}", kwargs=kwargs)


def _with_grads(op, n_rows_in: int):
    """packed batch function: forward + backward of ``op`` on packed items whose last tensor is dy."""

    def run(*packed, seqlens):
        *ins, dy = packed
        out, grads = run_with_grads(lambda *a: op(*a, seqlens=seqlens), list(ins), dy)
        return (out,) + tuple(grads)

    return packed_op(run)


def modulation_item(d: int, lo: int, hi: int):
    def make(gen):
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        return (randn(n, d, gen=gen), randn(1, d, gen=gen, scale=0.5), randn(1, d, gen=gen, scale=0.5), randn(n, d, gen=gen))
    return make


def gate_item(d: int, lo: int, hi: int):
    def make(gen):
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        return (randn(n, d, gen=gen), randn(n, d, gen=gen), randn(1, d, gen=gen, scale=0.5), randn(n, d, gen=gen))
    return make


def _mod(x, shift, scale, *, seqlens, config=None):
    return N.adaln_modulation(x, shift, scale, seqlens=seqlens, eps=EPS, config=config)


def _mod_with(config):
    """:func:`_mod` under the launch ``config``."""
    return lambda x, shift, scale, *, seqlens: _mod(x, shift, scale, seqlens=seqlens, config=config)


def _gate(x, y, gate, *, seqlens):
    return N.adaln_gate_residual(x, y, gate, seqlens=seqlens)


def check_modulation_accuracy(d, seq, target):
    gen = generator(1)
    b = len(seq)
    x, sh, sc = randn(sum(seq), d, gen=gen), _vec(b, d, gen, CPU_FP32), _vec(b, d, gen, CPU_FP32)
    kw = {"seqlens": seq, "eps": EPS}
    peer = P.adaln_modulation if target.device == "cuda" else None
    accuracy(N.adaln_modulation, lambda a, s, c, seqlens, eps: ref.adaln_modulation(a, s, c, seqlens, eps), [x, sh, sc],
             [0, 1, 2], "adaln_modulation", target, "triton adaln_modulation", kw, peer)


def check_gate_accuracy(d, seq, target):
    gen = generator(2)
    b = len(seq)
    x, y, g = randn(sum(seq), d, gen=gen), randn(sum(seq), d, gen=gen), _vec(b, d, gen, CPU_FP32)
    peer = P.adaln_gate_residual if target.device == "cuda" else None
    accuracy(N.adaln_gate_residual, lambda a, c, e, seqlens: ref.adaln_gate_residual(a, c, e, seqlens), [x, y, g], [0, 1, 2],
             "adaln_gate_residual", target, "triton adaln_gate_residual", {"seqlens": seq}, peer)


def check_final_accuracy(d, seq, target):
    gen = generator(3)
    b = len(seq)
    x, temb = randn(sum(seq), d, gen=gen), randn(b, d, gen=gen)
    w, bias = randn(2 * d, d, gen=gen, scale=d**-0.5), randn(2 * d, gen=gen, scale=0.1)
    peer = P.final_adaln_out if target.device == "cuda" else None
    accuracy(N.final_adaln_out, lambda a, t, ww, bb, seqlens, eps: ref.final_adaln_out(a, t, ww, bb, seqlens, eps),
             [x, temb, w, bias], [0, 1, 2, 3], "final_adaln_out", target, "triton final_adaln_out", {"seqlens": seq, "eps": EPS}, peer)


def check_txt_in_accuracy(ct, n, seq, target):
    gen = generator(4)
    x = randn(sum(seq), ct, gen=gen)
    gain = 1 + randn(ct, gen=gen, scale=0.1)
    w, bias = randn(n, ct, gen=gen, scale=ct**-0.5), randn(n, gen=gen, scale=0.1)
    peer = P.txt_in_rmsnorm_linear if target.device == "cuda" else None
    accuracy(N.txt_in_rmsnorm_linear,
             lambda a, g, ww, bb, seqlens, eps: ref.txt_in_rmsnorm_linear(a, g, ww, bb, eps=eps, seqlens=seqlens),
             [x, gain, w, bias], [0, 1, 2, 3], "txt_in_rmsnorm_linear", target, "triton txt_in_rmsnorm_linear",
             {"seqlens": seq, "eps": EPS}, peer)


def check_invariance(d, target, batch_sizes, lo, hi):
    check_row_invariance(_with_grads(_mod, 3), modulation_item(d, lo, hi), batch_sizes, target=target,
                         what=f"triton adaln_modulation fwd+bwd {target.label}")
    check_row_invariance(_with_grads(_gate, 3), gate_item(d, lo, hi), batch_sizes, target=target,
                         what=f"triton adaln_gate_residual fwd+bwd {target.label}")


def check_thirds_keep_vector_bytes(d, seqlens, target):
    """With a row held as three tiles the LayerNorm backward's per-sample vectors (d_scale, d_shift) are the one-tile
    kernel's bytes: their sums run per column, down the rows, in either layout. Only dx takes the thirds' row tree
    (its accuracy: the accuracy checks)."""
    assert N.ln_thirds(d)
    gen = generator(21)
    m, b = sum(seqlens), len(seqlens)
    x, dy = (randn(m, d, gen=gen, target=target) for _ in range(2))
    sc = _vec(b, d, gen, target)
    _, mean, rstd = N.adaln_modulation_fwd(x, torch.zeros_like(sc), sc, seqlens, EPS, True)
    for launch in (L.LN_REFERENCE, N.LN_CONFIGS[x.dtype]):
        thirds = N.adaln_modulation_bwd(dy, x, sc, mean, rstd, seqlens, True, launch, thirds=True)
        one = N.adaln_modulation_bwd(dy, x, sc, mean, rstd, seqlens, True, launch, thirds=False)
        for name, u, v in zip(("d_shift", "d_scale"), thirds[1:], one[1:]):
            assert_bytes_equal(u, v, f"adaln_modulation {name} thirds vs one tile [{launch.label()}] {target.label}")


def check_gate_column_blocks_keep_bytes(d, seqlens, target, cols=None):
    """The gated-residual backward with a chunk's columns split over programs of ``cols`` lanes (None: the product's
    GATE_BWD_COLS) gives dy and d_gate byte-equal to one program per chunk (no sum crosses columns)."""
    gen = generator(22)
    m, b = sum(seqlens), len(seqlens)
    dout, yy = (randn(m, d, gen=gen, target=target) for _ in range(2))
    gate = _vec(b, d, gen, target)
    whole = triton.next_power_of_2(d)
    assert min(whole, cols or N.GATE_BWD_COLS) < whole, "the check needs more than one column block"
    for need_dy, need_gate in ((True, True), (True, False), (False, True)):
        split = N.gate_residual_bwd(dout, yy, gate, seqlens, need_dy, need_gate, cols=cols)
        one = N.gate_residual_bwd(dout, yy, gate, seqlens, need_dy, need_gate, cols=whole)
        for name, u, v in zip(("dy", "d_gate"), split, one):
            assert (u is None) == (v is None)
            if u is not None:
                assert_bytes_equal(u, v, f"adaln_gate_residual {name} column blocks vs one program [d {d}] {target.label}")


def check_sweep(d, target, counts):
    def item(n, gen):
        return (randn(n, d, gen=gen), randn(1, d, gen=gen, scale=0.5), randn(1, d, gen=gen, scale=0.5), randn(n, d, gen=gen))

    check_token_sweep(_with_grads(_mod, 3), item, counts, target=target, what=f"triton adaln_modulation {target.label}")

    def fwd(x, sh, sc, *, seqlens):
        return N.adaln_modulation(x, sh, sc, seqlens=seqlens, eps=EPS)

    def item_fwd(n, gen):
        return item(n, gen)[:3]

    check_token_sweep(packed_op(fwd), item_fwd, counts, target=target, row_local=True,
                      what=f"triton adaln_modulation rows {target.label}")


def check_txt_gain_fold(ct, n, target, lens):
    gen = generator(9)
    gain = 1 + randn(ct, gen=gen, target=target, scale=0.1)
    w, bias = randn(n, ct, gen=gen, target=target, scale=ct**-0.5), randn(n, gen=gen, target=target, scale=0.1)
    items = [randn(k, ct, gen=gen, target=target) for k in lens]
    gouts = [randn(k, n, gen=gen, target=target) for k in lens]

    def fn(batch, params):
        seq = tuple(t.shape[0] for t in batch)
        out = N.txt_in_rmsnorm_linear(torch.cat(batch), params[0], params[1], params[2], seqlens=seq, eps=EPS)
        return list(out.split(seq))

    check_param_grad_fold(fn, items, [gain, w, bias], gouts, what=f"triton txt_in_rmsnorm_linear {target.label} d_gain/dW/db")


def check_row_strided_vectors(d, seqlens, target):
    """Per-sample vectors passed as the column chunks of one (B, 6D) modulation product (row stride 6D, as the
    strict block passes them) give the bytes of contiguous copies: both operators' outputs and every gradient,
    the product's included."""
    gen = generator(31)
    b, m = len(seqlens), sum(seqlens)
    x, y, dy = (randn(m, d, gen=gen, target=target) for _ in range(3))
    mod = randn(b, 6 * d, gen=gen, target=target, scale=0.5)

    def run(copy: bool):
        xs, ys, ms = (t.detach().clone().requires_grad_(True) for t in (x, y, mod))
        shift, scale, gate = (c.contiguous() if copy else c for c in ms.chunk(6, dim=-1)[:3])
        assert copy or shift.stride(0) == 6 * d
        h = N.adaln_modulation(xs, shift, scale, seqlens=seqlens, eps=EPS)
        out = N.adaln_gate_residual(xs, h * ys, gate, seqlens=seqlens)
        out.backward(dy)
        return out.detach(), xs.grad, ys.grad, ms.grad

    for a, c, what in zip(run(False), run(True), ("out", "dx", "dy", "d_mod")):
        assert_bytes_equal(a, c, f"{what}: chunk views vs contiguous copies ({target.label})")


# ------------------------------------------------------------------------------------------------
# interpreter (CI)
# ------------------------------------------------------------------------------------------------


@interp
def test_accuracy_interpreter():
    check_modulation_accuracy(D, SEQ, CPU_FP32)
    check_gate_accuracy(D, SEQ, CPU_FP32)
    check_final_accuracy(D, (7, 0, 20), CPU_FP32)
    check_txt_in_accuracy(24, 20, (7, 0, 20), CPU_FP32)


@interp
def test_row_strided_vectors_interpreter():
    check_row_strided_vectors(D, SEQ, CPU_FP32)


@interp
def test_batch_invariance_interpreter():
    """Batches of 2 and 3 put a sample first, in the middle and last. Every program is one sample's chunk
    (the per-sample vectors fold that sample's chunks), so a batch of 8 reaches no other code under the
    interpreter; the GPU tests batch 8 and 64 at the model's width."""
    check_invariance(D, CPU_FP32, (2, 3), 1, 40)


D_THIRDS = 48  # 3 x 16: the LayerNorm forward holds the row as three 16-lane thirds (norms.ln_thirds), as 3072 on the GPU


@interp
def test_ln_thirds_accuracy_invariance_and_launches_interpreter():
    """The thirds kernels (D = 3·2^k): accuracy of adaln_modulation, adaln_gate_residual and final_adaln_out
    (forward and every gradient) vs FP64, the vectors' bytes as with one tile, alone == batched at every
    position, and every row grouping / read-ahead gives the reference launch's bytes across chunk ends. Widths
    that are not three powers of two keep one tile."""
    assert N.ln_thirds(D_THIRDS) and N.ln_thirds(3072) and not N.ln_thirds(D) and not N.ln_thirds(3 * 24)
    assert not N.ln_thirds(24) and not N.ln_thirds(4096)
    check_modulation_accuracy(D_THIRDS, SEQ, CPU_FP32)
    check_gate_accuracy(D_THIRDS, SEQ, CPU_FP32)
    check_final_accuracy(D_THIRDS, (7, 0, 20), CPU_FP32)
    check_invariance(D_THIRDS, CPU_FP32, (2, 3), 1, 20)
    check_thirds_keep_vector_bytes(D_THIRDS, (5, 0, 19, 1, 16, 17), CPU_FP32)
    check_gate_column_blocks_keep_bytes(D_THIRDS, (5, 0, 19, 1, 16, 17), CPU_FP32, cols=16)
    check_gate_column_blocks_keep_bytes(D, (5, 0, 19, 1, 16, 17), CPU_FP32, cols=16)  # the last block part-masked
    for launch in (L.LN_REFERENCE, N.LN_CONFIGS[torch.float32], N.LnConfig(fwd_rows=3, fwd_ahead=1),
                   N.LnConfig(fwd_rows=4, fwd_ahead=0, fwd_stages=2)):
        check_ln_launch_bytes(launch, D_THIRDS, (5, 0, 19, 1, 16, 17), CPU_FP32, final=False)


@interp
def test_token_sweep_interpreter():
    check_sweep(D, CPU_FP32, (1, 7, 15, 16, 17, 33))


def two_launch_total(part: torch.Tensor, ch, dtype: torch.dtype) -> torch.Tensor:
    """Levels 2 and 3 as two launches: the per-sample FP32 sums written out, then the level-3 chain over them
    (what ``total_sum`` did before it kept the per-sample sums in registers)."""
    per = S.per_sample_sums(part, ch, torch.float32, INTERPRET)
    out = torch.empty((1, part.shape[1]), dtype=dtype, device=part.device)
    seg = torch.tensor([0, ch.samples], dtype=torch.int32, device=part.device)
    S._launch_fold(per, seg, 1, out, S.CHAIN, INTERPRET)
    return out.reshape(-1)


def check_fold_tree(lens: tuple[int, ...], width: int, target: Target) -> None:
    """Level 2/3 of the segments tree: each sample's per-sample sum is the same whatever its neighbours; the
    gain-style total (one launch) equals the left fold of the samples alone and the two-launch composition,
    in FP32 and cast to the target's dtype."""
    gen = generator(5)
    parts = {n: randn(-(-n // S.CHUNK_ROWS), width, gen=gen, target=Target(target.device, torch.float32))
             for n in set(lens)}  # one FP32 partial row per chunk of the sample

    def per_sample(order):
        seq = tuple(lens[i] for i in order)
        ch = S.chunks(seq, torch.device(target.device))
        part = torch.cat([parts[lens[i]] for i in order])
        assert part.shape[0] == ch.n
        return ch, part, S.per_sample_sums(part, ch, torch.float32, INTERPRET), S.total_sum(part, ch, torch.float32, INTERPRET)

    alone = {i: per_sample([i])[2][0] for i in range(len(lens))}
    n = len(lens)
    for order in (list(range(n)), list(reversed(range(n))), [1, 0, *range(2, n)]):
        ch, part, sums, total = per_sample(order)
        for pos, i in enumerate(order):
            assert_bytes_equal(sums[pos], alone[i], f"sample {i} at position {pos}")
        fold = alone[order[0]].clone()
        for i in order[1:]:
            fold = fold + alone[i]
        assert_bytes_equal(total, fold, f"total of order {order} vs the left fold of the samples alone")
        assert_bytes_equal(total, two_launch_total(part, ch, torch.float32), f"total of order {order}, one launch vs two")
        assert_bytes_equal(S.total_sum(part, ch, target.dtype, INTERPRET), two_launch_total(part, ch, target.dtype),
                           f"total of order {order} in {target.dtype}, one launch vs two")


@interp
def test_fold_tree_depends_only_on_the_sample_interpreter():
    check_fold_tree((S.CHUNK_ROWS * S.FOLD_TILE + 37, 5, 0, 40), 8, CPU_FP32)  # a sample of two fold tiles


@interp
def test_param_grad_fold_interpreter():
    check_txt_gain_fold(24, 20, CPU_FP32, (7, 1, 20, 0, 16))
    gen = generator(6)
    w, bias = randn(2 * D, D, gen=gen, scale=D**-0.5), randn(2 * D, gen=gen, scale=0.1)
    lens = (5, 17, 1)
    items = [(randn(k, D, gen=gen), randn(1, D, gen=gen)) for k in lens]
    gouts = [randn(k, D, gen=gen) for k in lens]

    def fn(batch, params):
        seq = tuple(t[0].shape[0] for t in batch)
        out = N.final_adaln_out(torch.cat([t[0] for t in batch]), torch.cat([t[1] for t in batch]), params[0], params[1],
                                seqlens=seq, eps=EPS)
        return list(out.split(seq))

    check_param_grad_fold(fn, items, [w, bias], gouts, what="triton final_adaln_out dW/db")


@interp
def test_empty_batches_interpreter():
    x = torch.zeros(0, D, requires_grad=True)
    sh = torch.zeros(2, D, requires_grad=True)
    sc = torch.zeros(2, D, requires_grad=True)
    y = N.adaln_modulation(x, sh, sc, seqlens=(0, 0), eps=EPS)
    y.sum().backward()
    assert y.shape == (0, D) and torch.equal(sh.grad, torch.zeros(2, D)) and torch.equal(sc.grad, torch.zeros(2, D))
    g = torch.ones(2, D, requires_grad=True)
    out = N.adaln_gate_residual(x.detach(), torch.zeros(0, D), g, seqlens=(0, 0))
    assert out.shape == (0, D)


@interp
def test_bad_inputs_raise_clear_errors():
    x, v = torch.zeros(6, D), torch.zeros(2, D)
    kw = {"seqlens": (2, 4), "eps": EPS}
    check_bad_inputs(N.adaln_modulation, [
        BadCase("3-d x", (torch.zeros(6, 1, D), v, v), kw, "(M, D)"),
        BadCase("fp64 x", (x.double(), v.double(), v.double()), kw, "fp32 or bf16"),
        BadCase("seqlens sum", (x, v, v), {"seqlens": (2, 3), "eps": EPS}, "sum to the 6 rows"),
        BadCase("negative seqlens", (x, v, v), {"seqlens": (7, -1), "eps": EPS}, "non-negative"),
        BadCase("shift rows", (x, torch.zeros(3, D), v), kw, "shift of shape (2, 40)"),
        BadCase("scale width", (x, v, torch.zeros(2, D + 1)), kw, "scale of shape"),
        BadCase("scale dtype", (x, v, v.double()), kw, "dtype"),
        BadCase("non-contiguous x", (torch.zeros(D, 6).t(), v, v), kw, "contiguous"),
    ])
    check_bad_inputs(N.adaln_gate_residual, [
        BadCase("y shape", (x, torch.zeros(6, D + 2), v), {"seqlens": (2, 4)}, "y of shape"),
        BadCase("gate shape", (x, x, torch.zeros(1, D)), {"seqlens": (2, 4)}, "gate of shape"),
    ])
    w = torch.zeros(2 * D, D)
    check_bad_inputs(N.final_adaln_out, [
        BadCase("weight rows", (x, v, torch.zeros(D, D), None), kw, "weight of shape (80"),
        BadCase("temb rows", (x, torch.zeros(3, D), w, None), kw, "temb of shape (2"),
    ])
    check_bad_inputs(N.txt_in_rmsnorm_linear, [
        BadCase("gain shape", (x, torch.zeros(D + 1), torch.zeros(4, D), None), kw, "gain of shape"),
        BadCase("odd width", (torch.zeros(6, 7), torch.zeros(7), torch.zeros(4, 7), None), kw, "even"),
    ])


# ---- LayerNorm launch configurations (norms.LnConfig: rows per forward program, read-ahead, register cap) -------
# None of them touches the arithmetic: every candidate (benchmarks/row_launches.py) must give the reference
# launch's bytes. The interpreter checks the row grouping and the read-ahead paths (it ignores the register cap);
# the GPU test checks every candidate as compiled.

LN_OTHERS = [c for c in L.LN_CANDIDATES if c != L.LN_REFERENCE]
# the interpreter ignores register caps and pipelining stages, but runs the loops they shape
_INTERP_LN = list(dict.fromkeys(N.LnConfig(c.fwd_rows, c.fwd_ahead, None, c.bwd_ahead, None, c.fwd_stages, c.bwd_stages)
                                for c in LN_OTHERS))


def _mod_grads(x, sh, sc, gy, seq, config):
    return run_with_grads(lambda a, b, c: N.adaln_modulation(a, b, c, seqlens=seq, eps=EPS, config=config), [x, sh, sc], gy)


# The reference launch's outputs per (case, op): computed once per session and shared by every launch compared
# with it (the case is drawn from a fixed seed, so it is the same tensors each time; CI time).
_REFERENCE_RUNS: dict = {}


def _reference(key, run):
    if key not in _REFERENCE_RUNS:
        _REFERENCE_RUNS[key] = run()
    return _REFERENCE_RUNS[key]


def check_ln_launch_bytes(launch, d, seq, target, final=True):
    """y, the saved mean / rstd, dx, d_shift, d_scale (and final_adaln_out's every gradient) under ``launch``
    equal the reference launch's bytes."""
    case = (d, tuple(seq), target)
    gen = generator(12)
    b, m = len(seq), sum(seq)
    x, gy = randn(m, d, gen=gen, target=target), randn(m, d, gen=gen, target=target)
    sh, sc = _vec(b, d, gen, target), _vec(b, d, gen, target)
    want_stats = _reference((case, "stats"), lambda: N.adaln_modulation_fwd(x, sh, sc, seq, EPS, store_stats=True,
                                                                         config=L.LN_REFERENCE))
    got_stats = N.adaln_modulation_fwd(x, sh, sc, seq, EPS, store_stats=True, config=launch)
    assert_bytes_equal(got_stats, want_stats, f"{launch.label()}: y, mean, rstd vs the reference {target.label}")
    want = _reference((case, "modulation"), lambda: _mod_grads(x, sh, sc, gy, seq, L.LN_REFERENCE))
    got = _mod_grads(x, sh, sc, gy, seq, launch)
    assert_bytes_equal(got[0], want[0], f"{launch.label()}: y vs the reference {target.label}")
    assert_bytes_equal(got[1], want[1], f"{launch.label()}: dx, d_shift, d_scale vs the reference {target.label}")
    if not final:
        return
    temb = randn(b, d, gen=gen, target=target)
    w, bias = randn(2 * d, d, gen=gen, target=target, scale=d**-0.5), randn(2 * d, gen=gen, target=target, scale=0.1)

    def fin(config):
        return lambda a, t, ww, bb: N.final_adaln_out(a, t, ww, bb, seqlens=seq, eps=EPS, config=config)

    want_f = _reference((case, "final"), lambda: run_with_grads(fin(L.LN_REFERENCE), [x, temb, w, bias], gy))
    got_f = run_with_grads(fin(launch), [x, temb, w, bias], gy)
    assert_bytes_equal(got_f[0], want_f[0], f"{launch.label()}: final_adaln_out vs the reference {target.label}")
    assert_bytes_equal(got_f[1], want_f[1], f"{launch.label()}: final_adaln_out grads vs the reference {target.label}")


@interp
@pytest.mark.parametrize("launch", _INTERP_LN, ids=lambda c: c.label())
def test_ln_launch_bytes_equal_reference_interpreter(launch):
    """Row groupings 1..8, with and without read-ahead, across chunk ends (1-, 16-, 17-row samples, an empty one)."""
    check_ln_launch_bytes(launch, D, (5, 0, 19, 33, 1, 16, 17), CPU_FP32, final=launch == _INTERP_LN[0])


@interp
@pytest.mark.slow
def test_ln_launch_batch_invariance_interpreter():
    """The reference launch and a one-row / no-read-ahead launch: alone vs batched at every position (batches of
    2 and 3, as test_batch_invariance_interpreter)."""
    for launch in (L.LN_REFERENCE, N.LnConfig(fwd_rows=1, fwd_ahead=0, bwd_ahead=0)):
        check_row_invariance(_with_grads(_mod_with(launch), 3), modulation_item(D, 1, 9), (2, 3), target=CPU_FP32,
                             what=f"triton adaln_modulation [{launch.label()}] fwd+bwd")


@interp
def test_ln_config_is_kept_by_the_autograd_node():
    """The launch given to the op at the forward is the one its backward uses."""
    x = torch.randn(5, D, requires_grad=True)
    shift, scale = torch.randn(1, D, requires_grad=True), torch.randn(1, D, requires_grad=True)
    other = N.LnConfig(fwd_rows=1, fwd_ahead=0, bwd_ahead=0)
    y = N.adaln_modulation(x, shift, scale, seqlens=(5,), eps=1e-6, config=other)
    assert y.grad_fn.config is other
    y.sum().backward()
    assert x.grad is not None and scale.grad is not None
    assert N.adaln_modulation(x, shift, scale, seqlens=(5,), eps=1e-6).grad_fn.config is None  # the frozen table


@interp  # the config checks run before any launch; the launches here take host tensors
def test_ln_configs_are_frozen_and_checked():
    assert {dt: N.ln_config(dt) for dt in (torch.bfloat16, torch.float32)} == dict(N.LN_CONFIGS)
    assert set(N.LN_CONFIGS.values()) <= set(L.LN_CANDIDATES) and L.LN_REFERENCE in L.LN_CANDIDATES
    with pytest.raises(TypeError):
        N.LN_CONFIGS[torch.float32] = L.LN_REFERENCE  # type: ignore[index]
    x = torch.randn(3, D)
    v = torch.randn(1, D)
    for bad in (N.LnConfig(fwd_rows=0), N.LnConfig(fwd_ahead=2), N.LnConfig(bwd_ahead=3), "one_row",
                N.LnConfig(fwd_ahead=1, fwd_stages=3), N.LnConfig(bwd_ahead=0, bwd_stages=1),
                N.LnConfig(bwd_ahead=0, bwd_stages=9)):
        with pytest.raises(ValueError, match="LnConfig"):
            N.adaln_modulation_fwd(x, v, v, (3,), EPS, store_stats=False, config=bad)
    from mmdit_strict.kernels.registry import implementations

    (impl,) = [i for i in implementations("adaln_modulation") if i.backend == "triton"]
    assert impl.config["ln_launch"]["bfloat16"] == N.LN_CONFIGS[torch.bfloat16].label()


def test_registered_for_cuda_strict_fp32_and_bf16():
    from mmdit_strict.kernels.registry import implementations

    for op in ("adaln_modulation", "adaln_gate_residual", "final_adaln_out", "txt_in_rmsnorm_linear"):
        impls = [i for i in implementations(op) if i.backend == "triton"]
        assert len(impls) == 1 and impls[0].device == "cuda" and impls[0].strict, op
        assert impls[0].dtypes == frozenset({torch.float32, torch.bfloat16}), op
        assert "chunk" in impls[0].reduction_order, op


# ------------------------------------------------------------------------------------------------
# GPU: Qwen-Image's widths (never in CI)
# ------------------------------------------------------------------------------------------------

QD, QCT = 3072, 3584
GPU_SEQ = (300, 0, 77)


@on_gpu_targets
def test_gpu_accuracy(target):
    skip_unless_compiled(target)
    check_modulation_accuracy(QD, GPU_SEQ, target)
    check_gate_accuracy(QD, GPU_SEQ, target)
    check_final_accuracy(QD, GPU_SEQ, target)
    check_txt_in_accuracy(QCT, QD, (90, 0, 37), target)


@on_gpu_targets
def test_gpu_row_strided_vectors(target):
    skip_unless_compiled(target)
    check_row_strided_vectors(QD, GPU_SEQ, target)


@on_gpu_targets
def test_gpu_batch_invariance(target):
    """Samples alone vs in batches of 2, 3, 8, 64 at every position (and reversed, and a probe at
    first/middle/last): y, dx, d_shift, d_scale (and y, dx, dy, d_gate) as raw bytes."""
    skip_unless_compiled(target)
    check_invariance(QD, target, (2, 3, 8, 64), 1, 40)


@on_gpu_targets
def test_gpu_thirds_keep_vector_bytes(target):
    skip_unless_compiled(target)
    check_thirds_keep_vector_bytes(QD, (300, 0, 77, 1, 16, 17), target)
    check_gate_column_blocks_keep_bytes(QD, (300, 0, 77, 1, 16, 17), target)


@on_gpu_targets
def test_gpu_token_sweep(target):
    skip_unless_compiled(target)
    check_sweep(QD, target, (1, 7, 15, 16, 17, 100, S.CHUNK_ROWS * S.FOLD_TILE + 1))


@on_gpu_targets
def test_gpu_fold_tree(target):
    """The one-launch total (QK and txt_in gains) = the two-launch composition, at the product's partial widths
    (128 for a head's gain, 3584 for txt_in's) and chunk counts of several fold tiles."""
    skip_unless_compiled(target)
    check_fold_tree((6889, 4096, 0, 77, 1), 128, target)
    check_fold_tree((S.CHUNK_ROWS * S.FOLD_TILE * 2 + 5, 256, 0), 3584, target)


@pytest.mark.gpu
def test_gpu_fp32_param_grad_fold():
    target = GPU_TARGETS[1]
    skip_unless_compiled(target)
    check_txt_gain_fold(QCT, 256, target, (7, 1, 130, 0, 33))


@on_gpu_targets
def test_gpu_no_host_sync_on_repeat(target):
    """A repeated call with the same seqlens launches without a host synchronisation (tables cached)."""
    skip_unless_compiled(target)
    gen = generator(8)
    seq = (100, 3)
    x = randn(sum(seq), QD, gen=gen, target=target).requires_grad_(True)
    sh, sc, gate = (randn(2, QD, gen=gen, target=target).requires_grad_(True) for _ in range(3))
    temb = randn(2, QD, gen=gen, target=target)
    w, bias = randn(2 * QD, QD, gen=gen, target=target, scale=QD**-0.5), randn(2 * QD, gen=gen, target=target)

    def step():
        h = N.adaln_modulation(x, sh, sc, seqlens=seq, eps=EPS)
        out = N.adaln_gate_residual(x, h, gate, seqlens=seq)
        out = N.final_adaln_out(out, temb, w, bias, seqlens=seq, eps=EPS)
        out.float().sum().backward()

    step()
    run_without_host_sync(step)


@on_gpu_targets
@pytest.mark.parametrize("launch", LN_OTHERS, ids=lambda c: c.label())
def test_gpu_ln_launch_bytes_equal_reference(target, launch):
    """At D = 3072 every launch candidate gives the reference launch's bytes (odd and even row counts, an
    empty sample, one-row and 16/17-row samples), final_adaln_out's gradients included, and keeps a sample's
    bytes alone vs in batches of 2, 3 and 8 (the default's full invariance and row sweep are the tests above)."""
    skip_unless_compiled(target)
    check_ln_launch_bytes(launch, QD, (300, 0, 77, 1, 16, 17), target)
    check_row_invariance(_with_grads(_mod_with(launch), 3), modulation_item(QD, 1, 40), (2, 3, 8), target=target,
                         what=f"triton adaln_modulation [{launch.label()}] fwd+bwd {target.label}")


@interp
def test_probe_chunk_lengths_interpreter():
    """The probes' chunk-length argument of the gated-residual and QK-norm backwards: dy / dx keep their bytes
    (row-local), the per-sample vector stays within the tolerance contract of FP64 at another chunk length,
    None is the product's CHUNK_ROWS, and nonsense is refused."""
    gen = generator(23)
    seq = (5, 0, 37, 1)
    m, b = sum(seq), len(seq)
    dout, yy = randn(m, D, gen=gen), randn(m, D, gen=gen)
    gate = _vec(b, D, gen, CPU_FP32)
    dy16, dg16 = N.gate_residual_bwd(dout, yy, gate, seq, True, True)
    assert_bytes_equal(N.gate_residual_bwd(dout, yy, gate, seq, True, True, chunk_rows=S.CHUNK_ROWS)[1], dg16,
                       "d_gate with chunk_rows = CHUNK_ROWS vs the default")
    want = torch.stack([(dout.double() * yy.double())[sum(seq[:i]):sum(seq[:i + 1])].sum(0) for i in range(b)])
    for ch in (4, 32):
        dy, dg = N.gate_residual_bwd(dout, yy, gate, seq, True, True, chunk_rows=ch)
        assert_bytes_equal(dy, dy16, f"gate dy with {ch}-row chunks")
        ok, abs_err, rel_err = row_tolerance("adaln_gate_residual_grad", torch.float32, want).check(dg, want)
        assert ok, f"d_gate with {ch}-row chunks: max abs error {abs_err}, max rel error {rel_err}"
    x, dq = randn(m, 2, 8, gen=gen), randn(m, 2, 8, gen=gen)
    gain = 1 + randn(8, gen=gen, scale=0.1)
    _, rstd = R.qk_norm_fwd(x, gain, None, None, EPS, True)
    dx16, _ = R.qk_norm_bwd(dq, x, gain, rstd, None, None, seq, True)
    for ch in (4, 32):
        assert_bytes_equal(R.qk_norm_bwd(dq, x, gain, rstd, None, None, seq, True, chunk_rows=ch)[0], dx16,
                           f"QK-norm dx with {ch}-token chunks")
    with pytest.raises(ValueError, match="power of two"):
        N.gate_residual_bwd(dout, yy, gate, seq, True, True, cols=24)
    with pytest.raises(ValueError, match="chunk_rows"):
        N.gate_residual_bwd(dout, yy, gate, seq, True, True, chunk_rows=0)
    with pytest.raises(ValueError, match="chunk_rows"):
        R.qk_norm_bwd(dq, x, gain, rstd, None, None, seq, True, chunk_rows=0)

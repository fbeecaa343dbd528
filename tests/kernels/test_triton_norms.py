"""CUDA strict modulation operators (``kernels/triton/norms.py``): adaln_modulation, adaln_gate_residual,
final_adaln_out, txt_in_rmsnorm_linear.

Without CUDA the kernels run under ``TRITON_INTERPRET=1`` (FP32, tiny widths, CI); with CUDA the
``@pytest.mark.gpu`` tests run Qwen-Image's widths (D = 3072, Ct = 3584) in bf16 and fp32
(``python -m pytest -m gpu tests/kernels/test_triton_norms.py``). Accuracy bounds: ``tolerances.yaml``
``row_ops.*`` (``atol_max``: a fraction of the tensor's max|ref|). Byte claims: tests/harness.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_rows import GPU_TARGETS, N, S, interp, skip_unless_compiled  # noqa: I001  (interpreter mode: tests/conftest.py)

from mmdit_strict.bench.norms import row_tolerance  # noqa: E402
from mmdit_strict.kernels import production as P  # noqa: E402
from mmdit_strict.reference import ops as ref  # noqa: E402
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


def _mod(x, shift, scale, *, seqlens):
    return N.adaln_modulation(x, shift, scale, seqlens=seqlens, eps=EPS)


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
def test_batch_invariance_interpreter():
    check_invariance(D, CPU_FP32, (2, 3, 8), 1, 40)


@interp
def test_token_sweep_interpreter():
    check_sweep(D, CPU_FP32, (1, 7, 15, 16, 17, 33))


@interp
def test_fold_tree_depends_only_on_the_sample_interpreter():
    """Level 2/3 of the segments tree: a sample of more than CHUNK_ROWS·FOLD_TILE rows (two fold tiles)
    gets the same per-sample sum, and the gain-style total the same left fold, whatever its neighbours."""
    big = S.CHUNK_ROWS * S.FOLD_TILE + 37
    lens = (big, 5, 0, 40)
    gen = generator(5)
    parts = {}
    for n in lens:
        parts[n] = randn(-(-n // S.CHUNK_ROWS), 8, gen=gen)  # one FP32 partial row per chunk of the sample

    def per_sample(order):
        seq = tuple(lens[i] for i in order)
        ch = S.chunks(seq, torch.device("cpu"))
        part = torch.cat([parts[lens[i]] for i in order])
        assert part.shape[0] == ch.n
        return S.per_sample_sums(part, ch, torch.float32, True), S.total_sum(part, ch, torch.float32, True)

    alone = {i: per_sample([i])[0][0] for i in range(len(lens))}
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 0, 3, 2]):
        sums, total = per_sample(order)
        for pos, i in enumerate(order):
            assert_bytes_equal(sums[pos], alone[i], f"sample {i} at position {pos}")
        fold = alone[order[0]].clone()
        for i in order[1:]:
            fold = fold + alone[i]
        assert_bytes_equal(total, fold, f"total of order {order} vs the left fold of the samples alone")


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


# ---- the "two_rows" LayerNorm variant (norms.ln_variant; off by default) ---------------------------
# On the GPU it must give the default ("one_row") bytes (each row sum an operand of a multi-operand tl.reduce in the
# same layout as its tl.sum: test_gpu_ln_variant_bytes_equal_default). The interpreter cannot show that:
# it evaluates tl.sum with numpy's pairwise sum but a multi-operand tl.reduce as a sequential fold, so
# there the row statistics (and y, dx, d_scale) differ in the last bits; d_shift (no row sum) is exact.

LN_VARIANTS = [v for v in N.LN_VARIANTS if v != N.DEFAULT_LN_VARIANT]  # every non-default LayerNorm variant


def _mod_grads(x, sh, sc, gy, seq):
    return run_with_grads(lambda a, b, c: N.adaln_modulation(a, b, c, seqlens=seq, eps=EPS), [x, sh, sc], gy)


@interp
@pytest.mark.parametrize("variant", LN_VARIANTS)
def test_ln_variant_accuracy_interpreter(variant):
    with N.ln_variant(variant):
        check_modulation_accuracy(D, SEQ, CPU_FP32)
        check_final_accuracy(D, (7, 0, 20), CPU_FP32)


@interp
@pytest.mark.slow
@pytest.mark.parametrize("variant", LN_VARIANTS)
def test_ln_variant_batch_invariance_interpreter(variant):
    """Forward, dx, d_shift, d_scale alone vs batched at every position; odd and even row counts across the
    16-row chunk boundary (row b masked at a chunk's end); d_shift equals the default's bytes."""
    with N.ln_variant(variant):
        check_row_invariance(_with_grads(_mod, 3), modulation_item(D, 1, 9), (2, 3, 8), target=CPU_FP32,
                             what=f"triton adaln_modulation {variant} fwd+bwd")
        check_sweep(D, CPU_FP32, (1, 2, 17))
    gen = generator(10)
    seq = (5, 0, 19, 33, 1)
    x, sh, sc, gy = randn(sum(seq), D, gen=gen), _vec(5, D, gen, CPU_FP32), _vec(5, D, gen, CPU_FP32), randn(sum(seq), D, gen=gen)
    want = _mod_grads(x, sh, sc, gy, seq)
    with N.ln_variant(variant):
        got = _mod_grads(x, sh, sc, gy, seq)
    assert_bytes_equal(got[1][1], want[1][1], f"{variant} d_shift vs the default")


@interp
def test_ln_variant_is_kept_and_checked_interpreter():
    """A node keeps the LayerNorm variant of its forward (the saved mean/rstd are that variant's); bad names raise."""
    gen = generator(11)
    x, sh, sc, gy = randn(21, D, gen=gen), _vec(1, D, gen, CPU_FP32), _vec(1, D, gen, CPU_FP32), randn(21, D, gen=gen)
    with N.ln_variant("two_rows"):
        want = _mod_grads(x, sh, sc, gy, (21,))
        leaves = [t.clone().requires_grad_(True) for t in (x, sh, sc)]
        y = N.adaln_modulation(*leaves, seqlens=(21,), eps=EPS)
    got = torch.autograd.grad(y, leaves, gy)  # backward outside the block
    assert_bytes_equal(got, want[1], "two_rows backward run outside the block")
    with pytest.raises(ValueError, match="LayerNorm variant"), N.ln_variant("rows2"):
        pass
    with pytest.raises(ValueError, match="LayerNorm variant"):
        N.adaln_modulation_fwd(x, sh, sc, (21,), EPS, store_stats=False, variant="rows2")
    assert N.current_ln_variant() == N.DEFAULT_LN_VARIANT


def test_ln_variant_identity():
    """adaln_modulation and final_adaln_out name the kernels and tree of the variant in force."""
    from mmdit_strict.kernels.registry import implementations

    for op in ("adaln_modulation", "final_adaln_out"):
        (impl,) = [i for i in implementations(op) if i.backend == "triton"]
        default = impl.identity()
        assert default["variant"] == N.DEFAULT_LN_VARIANT
        assert (default["kernel"], default["reduction_order"]) == (impl.kernel_name, impl.reduction_order)
        with N.ln_variant("two_rows"):
            two = impl.identity()
        assert two["variant"] == "two_rows" and "_adaln_mod_bwd2_kernel" in two["kernel"] and "tl.reduce" in two["reduction_order"]


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


@pytest.mark.gpu
@pytest.mark.parametrize("target", GPU_TARGETS, ids=lambda t: t.label)
def test_gpu_accuracy(target):
    skip_unless_compiled(target)
    check_modulation_accuracy(QD, GPU_SEQ, target)
    check_gate_accuracy(QD, GPU_SEQ, target)
    check_final_accuracy(QD, GPU_SEQ, target)
    check_txt_in_accuracy(QCT, QD, (90, 0, 37), target)


@pytest.mark.gpu
@pytest.mark.parametrize("target", GPU_TARGETS, ids=lambda t: t.label)
def test_gpu_batch_invariance(target):
    """Samples alone vs in batches of 2, 3, 8, 64 at every position (and reversed, and a probe at
    first/middle/last): y, dx, d_shift, d_scale (and y, dx, dy, d_gate) as raw bytes."""
    skip_unless_compiled(target)
    check_invariance(QD, target, (2, 3, 8, 64), 1, 40)


@pytest.mark.gpu
@pytest.mark.parametrize("target", GPU_TARGETS, ids=lambda t: t.label)
def test_gpu_token_sweep(target):
    skip_unless_compiled(target)
    check_sweep(QD, target, (1, 7, 15, 16, 17, 100, S.CHUNK_ROWS * S.FOLD_TILE + 1))


@pytest.mark.gpu
def test_gpu_fp32_param_grad_fold():
    target = GPU_TARGETS[1]
    skip_unless_compiled(target)
    check_txt_gain_fold(QCT, 256, target, (7, 1, 130, 0, 33))


@pytest.mark.gpu
@pytest.mark.parametrize("target", GPU_TARGETS, ids=lambda t: t.label)
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


@pytest.mark.gpu
@pytest.mark.parametrize("target", GPU_TARGETS, ids=lambda t: t.label)
@pytest.mark.parametrize("variant", LN_VARIANTS)
def test_gpu_ln_variant_bytes_equal_default(target, variant):
    """At D = 3072 the variant gives the default's bytes: y, the saved mean / rstd, dx, d_shift, d_scale
    (odd and even row counts, an empty sample, a one-row sample), and final_adaln_out's every gradient;
    then alone vs batched and the row-count sweep under the variant."""
    skip_unless_compiled(target)
    gen = generator(12)
    seq = (300, 0, 77, 1, 16, 17)
    b, m = len(seq), sum(seq)
    x, gy = randn(m, QD, gen=gen, target=target), randn(m, QD, gen=gen, target=target)
    sh, sc = _vec(b, QD, gen, target), _vec(b, QD, gen, target)
    want_stats = N.adaln_modulation_fwd(x, sh, sc, seq, EPS, store_stats=True, variant=N.DEFAULT_LN_VARIANT)
    got_stats = N.adaln_modulation_fwd(x, sh, sc, seq, EPS, store_stats=True, variant=variant)
    assert_bytes_equal(got_stats, want_stats, f"{variant} y, mean, rstd vs the default {target.label}")
    want = _mod_grads(x, sh, sc, gy, seq)
    with N.ln_variant(variant):
        got = _mod_grads(x, sh, sc, gy, seq)
    assert_bytes_equal(got[0], want[0], f"{variant} y vs the default {target.label}")
    assert_bytes_equal(got[1], want[1], f"{variant} dx, d_shift, d_scale vs the default {target.label}")
    temb = randn(b, QD, gen=gen, target=target)
    w, bias = randn(2 * QD, QD, gen=gen, target=target, scale=QD**-0.5), randn(2 * QD, gen=gen, target=target, scale=0.1)

    def final(a, t, ww, bb):
        return N.final_adaln_out(a, t, ww, bb, seqlens=seq, eps=EPS)

    want_f = run_with_grads(final, [x, temb, w, bias], gy)
    with N.ln_variant(variant):
        got_f = run_with_grads(final, [x, temb, w, bias], gy)
    assert_bytes_equal(got_f[0], want_f[0], f"{variant} final_adaln_out vs the default {target.label}")
    assert_bytes_equal(got_f[1], want_f[1], f"{variant} final_adaln_out grads vs the default {target.label}")
    with N.ln_variant(variant):
        check_row_invariance(_with_grads(_mod, 3), modulation_item(QD, 1, 40), (2, 3, 8, 64), target=target,
                             what=f"triton adaln_modulation {variant} fwd+bwd {target.label}")
        check_sweep(QD, target, (1, 2, 7, 15, 16, 17, 100, S.CHUNK_ROWS * S.FOLD_TILE + 1))

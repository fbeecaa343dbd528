"""CUDA strict QK preprocessing (``kernels/triton/rope.py``): qk_rmsnorm, multi_axis_rope and the fused
qk_rmsnorm_rope, which must give the unfused pair's bytes forward and backward.

Interpreter (FP32, tiny heads) in CI; ``@pytest.mark.gpu`` tests at Qwen-Image's 24 heads × 128 in bf16
and fp32. Accuracy bounds: ``tolerances.yaml`` ``row_ops.*``. Byte claims: tests/harness.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_rows import GPU_TARGETS, R, interp, on_gpu_targets, skip_unless_compiled  # noqa: I001  (interpreter mode: tests/conftest.py)

from mmdit_strict.kernels import production as P  # noqa: E402
from mmdit_strict.model.rope import rope_tables  # noqa: E402
from mmdit_strict.reference import ops as ref  # noqa: E402
from tests.harness import (  # noqa: E402
    CPU_FP32,
    BadCase,
    Target,
    assert_bytes_equal,
    check_bad_inputs,
    check_param_grad_fold,
    check_row_invariance,
    check_token_sweep,
    generator,
    packed_op,
    randn,
    run_with_grads,
    run_without_host_sync,
)
from tests.kernels.test_triton_norms import accuracy  # noqa: E402
from benchmarks import row_launches as L  # noqa: E402

EPS = 1e-6
H, DH = 3, 12  # interpreter heads and head width (d/2 = 6: not a power of two)
SEQ = (5, 0, 19, 33)


def _tables(m: int, d: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 cos/sin of FP64 angles in [0, 200) rad, as the model's tables are built."""
    ang = 200.0 * torch.rand(m, d // 2, generator=gen, dtype=torch.float64)
    return torch.cos(ang).float(), torch.sin(ang).float()


def _gain(d: int, gen) -> torch.Tensor:
    return 1 + randn(d, gen=gen, scale=0.1)


def _qk_case(h: int, d: int, m: int, gen: torch.Generator, target: Target) -> tuple[torch.Tensor, ...]:
    """(x, gain, cos, sin, gy) on ``target``, drawn in that order: x and gy (m, h, d) and the gain in the
    target dtype, the FP32 tables moved to its device."""
    x, gain = randn(m, h, d, gen=gen, target=target), _gain(d, gen).to(target.device, target.dtype)
    cos, sin = (t.to(target.device) for t in _tables(m, d, gen))
    gy = randn(m, h, d, gen=gen, target=target)
    return x, gain, cos, sin, gy


def _rope_kw(cfg: dict) -> dict:
    """The part of ``cfg`` (``fwd_config`` / ``bwd_config`` of the QK ops) that multi_axis_rope takes."""
    return {k: v for k, v in cfg.items() if k == "fwd_config"}


def _qk_ops(cos: torch.Tensor, sin: torch.Tensor, seq, **cfg) -> dict:
    """``fn(x, gain)`` for the norm alone, the unfused pair (norm then rope) and the fused op over ``seq``;
    ``cfg``: launches other than the frozen ones (``fwd_config`` / ``bwd_config``)."""
    return {"qk_rmsnorm": lambda a, g: R.qk_rmsnorm(a, g, seqlens=seq, eps=EPS, **cfg),
            "unfused": lambda a, g: R.multi_axis_rope(R.qk_rmsnorm(a, g, seqlens=seq, eps=EPS, **cfg), cos, sin,
                                                      **_rope_kw(cfg)),
            "fused": lambda a, g: R.qk_rmsnorm_rope(a, g, cos, sin, seqlens=seq, eps=EPS, **cfg)}


def check_accuracy(h, d, seq, target):
    gen = generator(11)
    m = sum(seq)
    x, gain = randn(m, h, d, gen=gen), _gain(d, gen)
    cos, sin = _tables(m, d, gen)
    kw = {"seqlens": seq, "eps": EPS}
    cuda = target.device == "cuda"
    accuracy(R.qk_rmsnorm, lambda a, g, seqlens, eps: ref.qk_rmsnorm(a, g, eps, seqlens=seqlens), [x, gain], [0, 1],
             "qk_rmsnorm", target, "triton qk_rmsnorm", kw, P.qk_rmsnorm if cuda else None)
    # the tables stay FP32 (as the model passes them) whatever the execution dtype
    accuracy(lambda a: R.multi_axis_rope(a, cos.to(a.device), sin.to(a.device)),
             lambda a: ref.multi_axis_rope(a, cos.double(), sin.double()), [x], [0],
             "multi_axis_rope", target, "triton multi_axis_rope")
    accuracy(lambda a, g, seqlens, eps: R.qk_rmsnorm_rope(a, g, cos.to(a.device), sin.to(a.device), seqlens=seqlens, eps=eps),
             lambda a, g, seqlens, eps: ref.multi_axis_rope(ref.qk_rmsnorm(a, g, eps), cos.double(), sin.double()),
             [x, gain], [0, 1], "qk_rmsnorm_rope", target, "triton qk_rmsnorm_rope", kw)


def check_fused_equals_unfused(h, d, seq, target):
    """Forward, dx and d_gain of the fused op are the unfused pair's bytes."""
    x, gain, cos, sin, gy = _qk_case(h, d, sum(seq), generator(12), target)
    ops = _qk_ops(cos, sin, seq)
    unfused, fused = ops["unfused"], ops["fused"]
    out_u, grads_u = run_with_grads(unfused, [x, gain], gy)
    out_f, grads_f = run_with_grads(fused, [x, gain], gy)
    assert_bytes_equal(out_f, out_u, f"fused vs unfused forward {target.label}")
    assert_bytes_equal(grads_f[0], grads_u[0], f"fused vs unfused dx {target.label}")
    assert_bytes_equal(grads_f[1], grads_u[1], f"fused vs unfused d_gain {target.label}")
    with torch.no_grad():
        assert_bytes_equal(fused(x, gain), out_u, f"fused no-grad forward {target.label}")


def _qk_item(h, d, lo, hi):
    def make(gen):
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        c, s = _tables(n, d, gen)
        return (randn(n, h, d, gen=gen), c, s, randn(n, h, d, gen=gen))
    return make


def _fused_with_grads(gain: torch.Tensor, fused: bool, **cfg):
    """packed batch fn: forward + dx of qk_rmsnorm(+rope); d_gain of the batch is checked by the fold test."""

    def run(x, cos, sin, dy, *, seqlens):
        c, s = cos.float(), sin.float()  # the harness casts every input to the target dtype; tables are FP32

        def op(a):
            if fused:
                return R.qk_rmsnorm_rope(a, gain, c, s, seqlens=seqlens, eps=EPS, **cfg)
            return R.multi_axis_rope(R.qk_rmsnorm(a, gain, seqlens=seqlens, eps=EPS, **cfg), c, s, **_rope_kw(cfg))

        out, (dx,) = run_with_grads(op, [x], dy)
        return out, dx

    return packed_op(run)


def check_invariance(h, d, target, batch_sizes, lo, hi, **cfg):
    gain = _gain(d, generator(13)).to(target.device, target.dtype)
    for fused in (True, False):
        check_row_invariance(_fused_with_grads(gain, fused, **cfg), _qk_item(h, d, lo, hi), batch_sizes, target=target,
                             what=f"triton qk_rmsnorm{'_rope' if fused else ' + multi_axis_rope'} fwd+dx {target.label}")


def check_sweep(h, d, target, counts, **cfg):
    gain = _gain(d, generator(14)).to(target.device, target.dtype)

    def item(n, gen):
        return _qk_item(h, d, n, n)(gen)

    check_token_sweep(_fused_with_grads(gain, True, **cfg), item, counts, target=target, row_local=True,
                      what=f"triton qk_rmsnorm_rope {target.label}")


def check_gain_fold(h, d, target, lens, **cfg):
    gen = generator(15)
    gain = _gain(d, gen).to(target.device, target.dtype)
    items = []
    for k in lens:
        c, s = _tables(k, d, gen)
        items.append((randn(k, h, d, gen=gen, target=target), c.to(target.device), s.to(target.device)))
    gouts = [randn(k, h, d, gen=gen, target=target) for k in lens]
    for fused in (True, False):
        def fn(batch, params, fused=fused):
            seq = tuple(t[0].shape[0] for t in batch)
            x, c, s = (torch.cat([t[i] for t in batch]) for i in range(3))
            if fused:
                out = R.qk_rmsnorm_rope(x, params[0], c, s, seqlens=seq, eps=EPS, **cfg)
            else:
                out = R.multi_axis_rope(R.qk_rmsnorm(x, params[0], seqlens=seq, eps=EPS, **cfg), c, s, **_rope_kw(cfg))
            return list(out.split(seq))

        check_param_grad_fold(fn, items, [gain], gouts, what=f"triton qk gain ({'fused' if fused else 'unfused'}) {target.label}")


# ------------------------------------------------------------------------------------------------
# interpreter (CI)
# ------------------------------------------------------------------------------------------------


@interp
def test_accuracy_interpreter():
    check_accuracy(H, DH, SEQ, CPU_FP32)


@interp
def test_fused_equals_unfused_interpreter():
    check_fused_equals_unfused(H, DH, SEQ, CPU_FP32)


@interp
def test_one_head_interpreter():
    """One head (the txt_in RMSNorm's shape, scaled down): BLOCK_H = 1."""
    check_accuracy(1, 14, (4, 0, 9), CPU_FP32)
    check_fused_equals_unfused(1, 14, (4, 0, 9), CPU_FP32)


@interp
def test_misaligned_input_same_bytes_interpreter():
    """A contiguous view whose storage starts off a 16-byte boundary runs on an aligned copy: same bytes
    as the aligned tensor, forward, dx and d_gain."""
    gen = generator(23)
    m = 11
    x, gain, gy = randn(m, H, DH, gen=gen), _gain(DH, gen), randn(m, H, DH, gen=gen)
    cos, sin = _tables(m, DH, gen)
    buf = torch.empty(x.numel() + 1)
    shifted = buf[1:].view(m, H, DH)
    shifted.copy_(x)
    assert shifted.data_ptr() % 16 and shifted.is_contiguous()

    def fused(a, g):
        return R.qk_rmsnorm_rope(a, g, cos, sin, seqlens=(m,), eps=EPS)

    want = run_with_grads(fused, [x, gain], gy)
    got = run_with_grads(fused, [shifted, gain], gy)
    assert_bytes_equal(got[0], want[0], "misaligned forward")
    assert_bytes_equal(got[1][0], want[1][0], "misaligned dx")
    assert_bytes_equal(got[1][1], want[1][1], "misaligned d_gain")


@interp
def test_batch_invariance_interpreter():
    """Batches of 2 and 3 put a sample first, in the middle and last. Every program is one sample's token
    (forward) or one sample's chunk (backward), so a batch of 8 reaches no other code under the interpreter;
    the GPU test batches 8 and 64 at the model's shape."""
    check_invariance(H, DH, CPU_FP32, (2, 3), 1, 12)


@interp
def test_token_sweep_interpreter():
    check_sweep(H, DH, CPU_FP32, (1, 7, 15, 16, 17, 33))


@interp
def test_gain_grad_fold_interpreter():
    check_gain_fold(H, DH, CPU_FP32, (7, 1, 20, 0, 16))


@interp
def test_model_tables_interpreter():
    """With the model's own RoPE tables (axes 16/56/56 scaled down to 2/2/2 here, centred image grid and
    text on the diagonal) the fused op still equals the pair, and RoPE matches the FP64 reference."""
    ic, is_, tc, ts = rope_tables([(1, 3, 4)], 5, (2, 2, 2), 10000.0)
    x = randn(12, 2, 6, gen=generator(16))
    gain = _gain(6, generator(17))
    out = R.qk_rmsnorm_rope(x, gain, ic, is_, seqlens=(12,), eps=EPS)
    assert_bytes_equal(out, R.multi_axis_rope(R.qk_rmsnorm(x, gain, seqlens=(12,), eps=EPS), ic, is_), "model tables")
    xt = randn(5, 2, 6, gen=generator(18))
    err = (R.multi_axis_rope(xt, tc, ts).double() - ref.multi_axis_rope(xt, tc.double(), ts.double())).abs().max()
    assert float(err) < 1e-6


@interp
def test_bad_inputs_raise_clear_errors():
    x = torch.zeros(6, H, DH)
    g = torch.ones(DH)
    c = torch.zeros(6, DH // 2)
    kw = {"seqlens": (2, 4), "eps": EPS}
    check_bad_inputs(R.qk_rmsnorm, [
        BadCase("2-d x", (torch.zeros(6, DH), g), kw, "(M, H, d)"),
        BadCase("odd head width", (torch.zeros(6, H, 7), torch.ones(7)), kw, "even head width"),
        BadCase("gain shape", (x, torch.ones(DH + 2)), kw, "gain of shape (12,)"),
        BadCase("gain dtype", (x, g.double()), kw, "gain of dtype"),
        BadCase("fp16 x", (x.half(), g.half()), kw, "fp32 or bf16"),
        BadCase("seqlens", (x, g), {"seqlens": (1, 4), "eps": EPS}, "sum to the 6 rows"),
        BadCase("non-contiguous", (torch.zeros(H, 6, DH).transpose(0, 1), g), kw, "contiguous"),
    ])
    check_bad_inputs(R.multi_axis_rope, [
        BadCase("table rows", (x, c[:5], c), {}, "cos of shape (6, 6)"),
        BadCase("table width", (x, c, torch.zeros(6, DH)), {}, "sin of shape"),
        BadCase("table dtype", (x, c.double(), c), {}, "float32"),
    ])
    check_bad_inputs(R.qk_rmsnorm_rope, [
        BadCase("table rows", (x, g, c[:4], c), kw, "cos of shape"),
    ])


def test_registered_for_cuda_strict_fp32_and_bf16():
    from mmdit_strict.kernels.registry import implementations

    for op in ("qk_rmsnorm", "multi_axis_rope"):
        impls = [i for i in implementations(op) if i.backend == "triton"]
        assert len(impls) == 1 and impls[0].device == "cuda" and impls[0].strict, op
        assert impls[0].dtypes == frozenset({torch.float32, torch.bfloat16}), op


# ---- launch configurations (rope.QkBwdConfig: read-ahead, register cap, stages; rope.QkFwdConfig) -------------
# None of them touches the arithmetic: forward, dx and d_gain must be the reference launch's bytes
# (benchmarks/row_launches.py: three tokens ahead; one token per forward program). The interpreter checks the
# read-ahead depths, groupings and head splits (it ignores the register cap); the GPU test checks every candidate.

QK_OTHERS = [c for c in L.QK_BWD_CANDIDATES if c != L.QK_BWD_REFERENCE]
QK_FWD_OTHERS = [c for c in L.QK_FWD_CANDIDATES if c != L.QK_FWD_REFERENCE]


def _as_kw(launch) -> dict:
    """The keyword that passes ``launch`` (a QkFwdConfig or a QkBwdConfig) to the QK ops."""
    return {"fwd_config": launch} if isinstance(launch, R.QkFwdConfig) else {"bwd_config": launch}


# The reference launch's outputs per (case, reference, op): computed once per session and shared by every launch
# compared with it (the case is drawn from a fixed seed, so it is the same tensors each time; CI time).
_REFERENCE_RUNS: dict = {}


def check_launch_bytes_equal_reference(h, d, seq, target, launch):
    """Forward, dx and d_gain under ``launch`` (a QkBwdConfig or a QkFwdConfig) = the reference launch's bytes
    (norm alone, unfused pair, fused; RoPE's backward runs the forward kernel)."""
    x, gain, cos, sin, gy = _qk_case(h, d, sum(seq), generator(25), target)
    reference = L.QK_FWD_REFERENCE if isinstance(launch, R.QkFwdConfig) else L.QK_BWD_REFERENCE
    want_ops = _qk_ops(cos, sin, seq, **_as_kw(reference))
    for name, op in _qk_ops(cos, sin, seq, **_as_kw(launch)).items():
        key = (h, d, tuple(seq), target.label, reference, name)
        if key not in _REFERENCE_RUNS:
            _REFERENCE_RUNS[key] = run_with_grads(want_ops[name], [x, gain], gy)
        want = _REFERENCE_RUNS[key]
        got = run_with_grads(op, [x, gain], gy)
        assert_bytes_equal(got[0], want[0], f"[{launch.label()}] {name} forward vs the reference {target.label}")
        assert_bytes_equal(got[1], want[1], f"[{launch.label()}] {name} dx, d_gain vs the reference {target.label}")


@interp
@pytest.mark.extended  # tuning candidates (read-ahead 1, 2), not the product launch: the device suite runs them
@pytest.mark.parametrize("ahead", (1, 2))
def test_bwd_launch_bytes_equal_reference_interpreter(ahead):
    """Read-ahead depths 1 and 2 vs 3, chunks of 1, 16, 17 and 33 tokens and an empty sample; one head too."""
    launch = R.QkBwdConfig(ahead)
    check_launch_bytes_equal_reference(H, DH, (5, 0, 19, 33, 1, 16, 17), CPU_FP32, launch)
    check_launch_bytes_equal_reference(1, 14, (4, 0, 19, 2), CPU_FP32, launch)


@interp
@pytest.mark.extended  # tuning candidates against the product's reference launch: the device suite runs them
@pytest.mark.parametrize("launch", (R.QkBwdConfig(0, None, 2), R.QkFwdConfig(3), R.QkFwdConfig(4, 2), R.QkFwdConfig(16, 3),
                                    R.QkFwdConfig(split_heads=True), R.QkFwdConfig(4, 2, split_heads=True)),
                         ids=lambda c: c.label())
def test_pipelined_and_grouped_launches_equal_reference_interpreter(launch):
    """The backward's pipelined token loop (read where used), forward programs of 3, 4 and 16 tokens (row counts
    that leave a short last program, an empty sample) and the forward's heads split in two tiles (3 = 2 + 1) give
    the reference launch's bytes; one head too (never split). The forward has no chunks: its row counts only need
    to leave a short last program (42 tokens); the backward's must cross chunk edges."""
    seq = (5, 0, 19, 1, 17) if isinstance(launch, R.QkFwdConfig) else (5, 0, 19, 33, 1, 16, 17)
    check_launch_bytes_equal_reference(H, DH, seq, CPU_FP32, launch)
    check_launch_bytes_equal_reference(1, 14, (4, 0, 19, 2), CPU_FP32, launch)


@interp
@pytest.mark.slow
def test_bwd_launch_batch_invariance_interpreter():
    """The reference launch (three tokens ahead) alone vs batched, swept across the chunk edge, d_gain fold.
    Batches of 2 and 3, as test_batch_invariance_interpreter (why not 8: there)."""
    kw = {"bwd_config": L.QK_BWD_REFERENCE}
    check_invariance(H, DH, CPU_FP32, (2, 3), 1, 12, **kw)
    check_sweep(H, DH, CPU_FP32, (1, 3, 16, 17, 33), **kw)
    check_gain_fold(H, DH, CPU_FP32, (7, 1, 20, 0, 16, 35), **kw)


@interp
def test_bwd_config_is_kept_by_the_autograd_node():
    """The backward launch given to the op at the forward travels with the autograd node to its backward."""
    x = torch.randn(6, H, DH, requires_grad=True)
    gain = torch.randn(DH, requires_grad=True)
    y = R.qk_rmsnorm(x, gain, seqlens=(6,), eps=1e-6, bwd_config=L.QK_BWD_REFERENCE)
    assert y.grad_fn.config is L.QK_BWD_REFERENCE
    y.sum().backward()
    assert x.grad is not None and gain.grad is not None
    assert R.qk_rmsnorm(x, gain, seqlens=(6,), eps=1e-6).grad_fn.config is None  # the frozen table, at the backward


@interp  # the config checks run before any launch; the launches here take host tensors
def test_bwd_configs_are_frozen_and_checked():
    keys = [(dt, one) for dt in (torch.bfloat16, torch.float32) for one in (False, True)]
    assert {(dt, one): R.qk_bwd_config(dt, 1 if one else 24) for dt, one in keys} == dict(R.QK_BWD_CONFIGS)
    assert set(R.QK_BWD_CONFIGS.values()) <= set(L.QK_BWD_CANDIDATES)
    with pytest.raises(TypeError):
        R.QK_BWD_CONFIGS[torch.float32, True] = R.QkBwdConfig()  # type: ignore[index]
    x = torch.randn(4, H, DH)
    gain = torch.randn(DH)
    _, rstd = R.qk_norm_fwd(x, gain, None, None, EPS, store_rstd=True)
    for bad in (R.QkBwdConfig(0), R.QkBwdConfig(4), R.QkBwdConfig(1, None, 3), R.QkBwdConfig(0, None, 1),
                R.QkBwdConfig(0, None, 9), "chunk_heads"):
        with pytest.raises(ValueError, match="QkBwdConfig"):
            R.qk_norm_bwd(x, x, gain, rstd, None, None, (4,), True, config=bad)


def test_head_tiles_split_only_where_fewer_heads_are_masked():
    assert R.head_tiles(24, False) == (32, 0) and R.head_tiles(24, True) == (16, 8)
    assert R.head_tiles(3, True) == (2, 1) and R.head_tiles(20, True) == (16, 4)
    for h in (1, 2, 16, 32):  # powers of two: one tile, nothing masked
        assert R.head_tiles(h, True) == (h, 0)
    assert R.head_tiles(28, True) == (32, 0)  # 16 + 16 holds as many lanes as one 32-head tile


def test_fwd_configs_are_frozen_and_checked():
    keys = [(dt, one) for dt in (torch.bfloat16, torch.float32) for one in (False, True)]
    assert {(dt, one): R.qk_fwd_config(dt, 1 if one else 24) for dt, one in keys} == dict(R.QK_FWD_CONFIGS)
    assert set(R.QK_FWD_CONFIGS.values()) <= set(L.QK_FWD_CANDIDATES)
    x = torch.randn(4, H, DH)
    gain = torch.randn(DH)
    for bad in (R.QkFwdConfig(0), R.QkFwdConfig(65), R.QkFwdConfig(4, 1), R.QkFwdConfig(4, 9), R.QkBwdConfig(1)):
        with pytest.raises(ValueError, match="QkFwdConfig"):
            R.qk_norm_fwd(x, gain, None, None, EPS, store_rstd=False, config=bad)


def test_identity_and_trace():
    """The registry identity names the one forward and the one backward kernel and the chunked d_gain tree."""
    from mmdit_strict.kernels.registry import implementations

    (impl,) = [i for i in implementations("qk_rmsnorm") if i.backend == "triton"]
    ident = impl.identity()
    assert "_qk_fwd_kernel" in ident["kernel"] and "_qk_bwd_chunk_kernel" in ident["kernel"]
    assert (ident["kernel"], ident["reduction_order"]) == (impl.kernel_name, impl.reduction_order)
    assert "once per chunk" in ident["reduction_order"]


# ------------------------------------------------------------------------------------------------
# GPU: 24 heads × 128 (never in CI)
# ------------------------------------------------------------------------------------------------

QH, QDH = 24, 128


# each check at 24 × 128 in both dtypes
GPU_CHECKS = {
    "accuracy": lambda t: check_accuracy(QH, QDH, (300, 0, 77), t),
    "fused_equals_unfused": lambda t: check_fused_equals_unfused(QH, QDH, (4096, 0, 256, 77), t),
    "batch_invariance": lambda t: check_invariance(QH, QDH, t, (2, 3, 8, 64), 1, 40),
    "token_sweep": lambda t: check_sweep(QH, QDH, t, (1, 7, 15, 16, 17, 100, 1025)),
}


@on_gpu_targets
@pytest.mark.parametrize("check", GPU_CHECKS)
def test_gpu_check(target, check):
    skip_unless_compiled(target)
    GPU_CHECKS[check](target)


@pytest.mark.gpu
def test_gpu_fp32_gain_grad_fold():
    target = GPU_TARGETS[1]
    skip_unless_compiled(target)
    check_gain_fold(QH, QDH, target, (7, 1, 130, 0, 1100))


def _compiled(fn) -> int:
    """How many binaries a @triton.jit function holds (over devices)."""
    return sum(len(cache[0]) for cache in fn.device_caches.values())


@on_gpu_targets
def test_gpu_one_binary_for_norm_rope_and_fused(target):
    """qk_rmsnorm, multi_axis_rope (both directions) and the fused op run ONE
    compiled forward kernel and qk_rmsnorm / fused share ONE compiled backward (runtime flags, no
    specialization on them): one layout, so one summation tree, for the fused and the unfused path.
    A head shape no other test uses (5 × 40), so every compile counted here is this test's."""
    skip_unless_compiled(target)
    seq = (33, 1, 16)
    x, gain, cos, sin, gy = _qk_case(5, 40, sum(seq), generator(24), target)
    ops = _qk_ops(cos, sin, seq)
    before = _compiled(R._qk_fwd_kernel), _compiled(R._qk_bwd_chunk_kernel)
    out_u, grads_u = run_with_grads(ops["unfused"], [x, gain], gy)
    out_f, grads_f = run_with_grads(ops["fused"], [x, gain], gy)
    run_with_grads(ops["qk_rmsnorm"], [x, gain], gy)
    with torch.no_grad():
        ops["qk_rmsnorm"](x, gain)
        ops["fused"](x, gain)
    after = _compiled(R._qk_fwd_kernel), _compiled(R._qk_bwd_chunk_kernel)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1), (before, after)
    assert_bytes_equal(out_f, out_u, f"fused vs unfused forward 5x40 {target.label}")
    assert_bytes_equal(grads_f, grads_u, f"fused vs unfused dx, d_gain 5x40 {target.label}")


@on_gpu_targets
def test_gpu_no_host_sync_on_repeat(target):
    skip_unless_compiled(target)
    gen = generator(19)
    seq = (100, 3)
    x = randn(103, QH, QDH, gen=gen, target=target).requires_grad_(True)
    gain = _gain(QDH, gen).to("cuda", target.dtype).requires_grad_(True)
    cos, sin = (t.cuda() for t in _tables(103, QDH, gen))

    def step():
        a = R.qk_rmsnorm_rope(x, gain, cos, sin, seqlens=seq, eps=EPS)
        b = R.multi_axis_rope(R.qk_rmsnorm(x, gain, seqlens=seq, eps=EPS), cos, sin)
        (a.float().sum() + b.float().sum()).backward()

    step()
    run_without_host_sync(step)


@on_gpu_targets
@pytest.mark.parametrize("launch", QK_OTHERS, ids=lambda c: c.label())
def test_gpu_qk_bwd_launch_bytes_equal_reference(target, launch):
    """Every launch candidate at 24 × 128 and txt_in's one head of 3584: forward, dx and d_gain = the
    reference launch's bytes (norm, unfused pair, fused), and a sample alone = in batches of 2, 3, 8; the
    frozen launch's full checks are test_gpu_check."""
    skip_unless_compiled(target)
    check_launch_bytes_equal_reference(QH, QDH, (4096, 0, 256, 77, 1, 16, 17), target, launch)
    check_launch_bytes_equal_reference(1, 3584, (256, 0, 77), target, launch)
    check_invariance(QH, QDH, target, (2, 3, 8), 1, 40, bwd_config=launch)


@on_gpu_targets
@pytest.mark.parametrize("launch", QK_FWD_OTHERS, ids=lambda c: c.label())
def test_gpu_qk_fwd_launch_bytes_equal_reference(target, launch):
    """Every forward launch candidate (tokens per program, pipelined loop) at 24 × 128 and at one head of 3584:
    forward, dx and d_gain = the one-token launch's bytes (norm, unfused pair, fused), and a sample alone = in
    batches of 2, 3, 8."""
    skip_unless_compiled(target)
    check_launch_bytes_equal_reference(QH, QDH, (4096, 0, 256, 77, 1, 16, 17), target, launch)
    check_launch_bytes_equal_reference(1, 3584, (256, 0, 77), target, launch)
    check_invariance(QH, QDH, target, (2, 3, 8), 1, 40, fwd_config=launch)

"""Strict GEMM engine (Triton) through the interpreter: FP32 on the CPU, tiny odd shapes.

``TRITON_INTERPRET=1`` must be set before ``@triton.jit`` runs (Triton reads it when the decorator
is applied, i.e. when the kernel module is imported), so this module sets it first and reloads the
kernel module if an earlier import compiled it for a GPU. BF16 is GPU-only (the interpreter's bf16
is wrong): ``python -m mmdit_strict.bench.gemm`` qualifies it on the H200.

Shapes are non-multiples of every tile of the small-shape configuration (BLOCK_M 16, BLOCK_N 32,
BLOCK_K 16; dW tiles 32×16 over 16-row chunks), so partial tiles in every dimension are exercised.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from mmdit_strict.kernels.triton import gemm as G  # noqa: E402

try:  # an earlier import may have compiled the kernels for a GPU; rebuild them for the interpreter
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(G._gemm_fwd_kernel, InterpretedFunction):
        G = importlib.reload(G)
except ImportError:  # pragma: no cover - layout of triton's internals changed
    pass

ref_ops = pytest.importorskip(
    "mmdit_strict.reference.ops", reason="the FP64 reference (mmdit_strict.reference.ops.linear) is missing"
)

M, K, N, R = 37, 53, 45, 5
SEQLENS = (10, 0, 27)
# FP32 with FP32 accumulation over K = 53: errors are a few ulp of the largest partial sums.
FWD_TOL = dict(rtol=2e-6, atol_frac=2e-6)
GRAD_TOL = dict(rtol=2e-6, atol_frac=2e-6)


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol_frac: float) -> tuple[bool, float]:
    err = (actual.double() - expected).abs()
    bound = rtol * expected.abs() + atol_frac * expected.abs().max()
    return bool((err <= bound).all()) and bool(torch.isfinite(actual).all()), float(err.max())


def _params(lora: bool, requires_grad: bool = False):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(N, K, generator=g) / K**0.5
    b = torch.randn(N, generator=g)
    a = torch.randn(R, K, generator=g) / K**0.5
    bl = torch.randn(N, R, generator=g)
    ts = [w, b, a, bl]
    for t in ts:
        t.requires_grad_(requires_grad)
    return w, b, ((a, bl, 0.5) if lora else None)


def _x(rows: int, seed: int = 0, requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(rows, K, generator=torch.Generator().manual_seed(seed)).requires_grad_(requires_grad)


CASES = [
    ("none", "none", False, True),
    ("none", "gelu_tanh", False, True),
    ("none", "silu", True, True),
    ("silu", "none", False, True),
    ("silu", "gelu_tanh", True, True),
    ("none", "none", True, False),
]


@pytest.mark.parametrize("prologue,epilogue,lora,bias", CASES)
def test_forward_matches_fp64_reference(prologue, epilogue, lora, bias):
    w, b, lo = _params(lora)
    b = b if bias else None
    x = _x(M)
    y = G.gemm(x, w, b, seqlens=SEQLENS, prologue=prologue, epilogue=epilogue, lora=lo)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    ref = ref_ops.linear(x, w, b, prologue, epilogue, lo)
    ok, err = _close(y, ref, **FWD_TOL)
    assert ok, f"forward max abs err {err:.3e} over tolerance {FWD_TOL}"


@pytest.mark.parametrize("prologue,epilogue,lora,bias", CASES)
def test_backward_matches_fp64_reference(prologue, epilogue, lora, bias):
    w, b, lo = _params(lora, requires_grad=True)
    b = b if bias else None
    x = _x(M, requires_grad=True)
    dy = torch.randn(M, N, generator=torch.Generator().manual_seed(7))
    inputs = [x, w] + ([b] if bias else []) + ([lo[0], lo[1]] if lora else [])
    y = G.gemm(x, w, b, seqlens=SEQLENS, prologue=prologue, epilogue=epilogue, lora=lo)
    got = torch.autograd.grad(y, inputs, dy)
    ref = ref_ops.linear(x, w, b, prologue, epilogue, lo)
    want = torch.autograd.grad(ref, inputs, dy.double())
    names = ["dx", "dW"] + (["db"] if bias else []) + (["dA", "dB"] if lora else [])
    for name, g_, r_ in zip(names, got, want):
        assert g_.dtype == torch.float32
        ok, err = _close(g_, r_, **GRAD_TOL)
        assert ok, f"{name}: max abs err {err:.3e} over tolerance {GRAD_TOL}"


@pytest.mark.parametrize("prologue,epilogue,lora", [("none", "gelu_tanh", True), ("silu", "none", False)])
def test_rows_are_batch_invariant_bytes(prologue, epilogue, lora):
    """Row r's output bytes are the same whatever M is and wherever the sample sits in the batch.

    Under the interpreter ``tl.dot`` is numpy's matmul, whose BLAS kernels may round a row
    differently by its position inside the (16-row) tile, so the CPU test moves rows by whole tiles
    only; the GPU qualification (``mmdit_strict.bench.gemm``) moves them by any offset.
    """
    w, b, lo = _params(lora)
    big = _x(70, seed=3)
    kw = dict(prologue=prologue, epilogue=epilogue, lora=lo)
    y_big = G.gemm(big, w, b, seqlens=(70,), **kw)
    for m in (1, 2, 3, 7, 16, 17, 33, 69):
        y = G.gemm(big[:m].contiguous(), w, b, seqlens=(m,), **kw)
        assert torch.equal(y, y_big[:m]), f"rows 0..{m} differ from the M=70 run"
    tile = 16  # BLOCK_M of the small-shape configuration
    for off, m in ((16, 5), (32, 17), (48, 22)):
        y = G.gemm(big[off:off + m].contiguous(), w, b, seqlens=(m,), **kw)
        assert torch.equal(y, y_big[off:off + m]), f"rows {off}..{off + m} differ from the M=70 run"
        both = torch.cat([big[off:off + m], big[:tile]])  # batched after another sample
        y = G.gemm(both, w, b, seqlens=(m, tile), **kw)
        assert torch.equal(y[:m], y_big[off:off + m]), "a sample's rows changed when batched with another"


def _fold(parts):
    acc = torch.zeros_like(parts[0])
    for p in parts:
        acc = acc + p
    return acc


@pytest.mark.parametrize("prologue", ["none", "silu"])
def test_weight_grad_is_a_sample_order_fold(prologue):
    """dW/db with seqlens (a, b, c, d) equal, in bytes, the FP32 left fold of per-sample partials and any
    micro-batch split continued through an FP32 buffer."""
    seqlens = (5, 0, 12, 20)
    m = sum(seqlens)
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(m, N, generator=gen)
    x = torch.randn(m, K, generator=gen)
    full = G.gemm_dw(g, x, seqlens, prologue=prologue, out_dtype=torch.float32)
    bfull = G.gemm_db(g, seqlens, out_dtype=torch.float32)
    starts = [0]
    for s in seqlens:
        starts.append(starts[-1] + s)
    parts = [G.gemm_dw(g[a:e].contiguous(), x[a:e].contiguous(), (e - a,), prologue=prologue, out_dtype=torch.float32)
             for a, e in zip(starts, starts[1:])]
    bparts = [G.gemm_db(g[a:e].contiguous(), (e - a,), out_dtype=torch.float32) for a, e in zip(starts, starts[1:])]
    assert torch.equal(full, _fold(parts))
    assert torch.equal(bfull, _fold(bparts))
    buf = torch.zeros(N, K)
    bbuf = torch.zeros(N)
    for lo, hi, sl in ((0, 5, (5,)), (5, 17, (0, 12)), (17, 37, (20,))):
        G.gemm_dw(g[lo:hi].contiguous(), x[lo:hi].contiguous(), sl, prologue=prologue, accumulate_into=buf)
        G.gemm_db(g[lo:hi].contiguous(), sl, accumulate_into=bbuf)
    assert torch.equal(full, buf)
    assert torch.equal(bfull, bbuf)


def test_lora_grads_do_not_depend_on_the_micro_batch_split():
    """Autograd dA/dB/dW/db over seqlens (a, b, c) equal the fold of each sample's own gradients.

    Samples start on 16-row tile boundaries here because the interpreter's forward (numpy matmul) is
    only row-invariant by whole tiles (see above); odd sample lengths are covered by the fold test.
    """
    seqlens = (16, 16, 11)
    w, b, lo = _params(True, requires_grad=True)
    x = _x(sum(seqlens), seed=9)
    dy = torch.randn(sum(seqlens), N, generator=torch.Generator().manual_seed(11))
    params = [w, b, lo[0], lo[1]]
    y = G.gemm(x, w, b, seqlens=seqlens, epilogue="gelu_tanh", lora=lo)
    whole = torch.autograd.grad(y, params, dy)
    per = []
    start = 0
    for s in seqlens:
        ys = G.gemm(x[start:start + s].contiguous(), w, b, seqlens=(s,), epilogue="gelu_tanh", lora=lo)
        per.append(torch.autograd.grad(ys, params, dy[start:start + s].contiguous()))
        start += s
    for i, name in enumerate(("dW", "db", "dA", "dB")):
        assert torch.equal(whole[i], _fold([p[i] for p in per])), f"{name} depends on the split"


def _bad(**over):
    w, b, lo = _params(True)
    args = dict(x=_x(M), weight=w, bias=b, seqlens=SEQLENS, prologue="none", epilogue="none", lora=lo)
    args.update(over)
    x = args.pop("x")
    return lambda: G.gemm(x, **args)


@pytest.mark.parametrize("over,match", [
    (dict(x=torch.randn(M, K + 1)), r"weight of shape"),
    (dict(x=torch.randn(M, K, dtype=torch.float64)), r"fp32 or bf16"),
    (dict(x=torch.randn(K, M).t()), r"contiguous"),
    (dict(x=torch.randn(M)), r"x of shape \(M, K\)"),
    (dict(weight=torch.randn(N, K, dtype=torch.bfloat16)), r"dtype"),
    (dict(bias=torch.randn(N + 1)), r"bias of shape"),
    (dict(seqlens=(1, 2)), r"seqlens sum"),
    (dict(seqlens=[10, 0, 27]), r"tuple"),
    (dict(prologue="gelu"), r"prologue"),
    (dict(epilogue="relu"), r"epilogue"),
    (dict(lora=(torch.randn(R, K), torch.randn(N, R + 1), 0.5)), r"lora B of shape"),
    (dict(lora=(torch.randn(R, K), torch.randn(N, R), "1")), r"scale"),
])
def test_bad_inputs_raise_clear_errors(over, match):
    with pytest.raises(ValueError, match=match):
        _bad(**over)()


def test_registered_for_cuda_strict_fp32_and_bf16():
    from mmdit_strict.kernels import registry

    for op in G.GEMM_OPS:
        for dt in ("fp32", "bf16"):
            impls = [i for i in registry._REGISTRY.get((op, "cuda", dt), []) if i.backend == "triton"]
            assert len(impls) == 1 and impls[0].strict, f"{op}/{dt} has no strict triton entry"
            ident = impls[0].identity()
            assert ident["split_k"] is False and ident["config"]["keyed_by"] == "(N, K, dtype)"


def test_configs_never_take_m():
    import inspect

    from mmdit_strict.kernels.triton import configs

    for fn in (configs.fwd_config, configs.dw_config):
        assert list(inspect.signature(fn).parameters) == ["n", "k", "dtype"]

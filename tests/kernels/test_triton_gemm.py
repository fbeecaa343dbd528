"""Strict GEMM engine (Triton): FP32 through the interpreter on the CPU (CI), FP32 and BF16 on CUDA.

Mode: without CUDA, ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` for the whole session before any
kernel module is imported; the interpreter tests (tiny odd shapes, FP32) run. With CUDA (and
``TRITON_INTERPRET`` unset) the kernels compile for the GPU: the interpreter tests skip and the
``@pytest.mark.gpu`` tests run the real layer classes in bf16 and fp32 through ``tests/harness.py``
(``python -m pytest -m gpu tests/kernels/test_triton_gemm.py``). BF16 never runs under the
interpreter (its bf16 is wrong). Tolerances: ``tolerances.yaml`` ``gemm.<check>.<dtype>``, whose
``atol_max`` is a fraction of max|ref| (``mmdit_strict.bench.gemm.gemm_tolerance``).

Shapes are non-multiples of every tile of the small-shape configuration (BLOCK_M 16, BLOCK_N 32,
BLOCK_K 16; dW tiles 32×16 over 16-row chunks), so partial tiles in every dimension are exercised.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

triton = pytest.importorskip("triton")

from mmdit_strict.kernels.triton.gemm import fpmath, kernels  # noqa: E402
from tests.kernels.triton_rows import (  # noqa: E402  (interpreter mode: tests/conftest.py)
    GPU_TARGETS,
    INTERPRET,
    G,
    interp,
    on_gpu_targets,
    skip_unless_compiled,
)

ref_ops = pytest.importorskip(
    "mmdit_strict.reference.ops", reason="the FP64 reference (mmdit_strict.reference.ops.linear) is missing"
)
from mmdit_strict.bench.gemm import gemm_tolerance  # noqa: E402
from tests.harness import assert_bytes_equal  # noqa: E402

M, K, N, R = 37, 53, 45, 5
SEQLENS = (10, 0, 27)


def _close(actual: torch.Tensor, expected: torch.Tensor, check: str) -> tuple[bool, float, object]:
    """``tolerances.yaml gemm.<check>.fp32``: |err| <= rtol·|ref| + atol·max|ref|."""
    tol = gemm_tolerance(check, torch.float32, expected)
    ok, max_abs, _ = tol.check(actual, expected)
    return ok, max_abs, tol


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


@interp
@pytest.mark.parametrize("prologue,epilogue,lora,bias", CASES)
def test_forward_matches_fp64_reference(prologue, epilogue, lora, bias):
    w, b, lo = _params(lora)
    b = b if bias else None
    x = _x(M)
    y = G.gemm(x, w, b, seqlens=SEQLENS, prologue=prologue, epilogue=epilogue, lora=lo)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    ref = ref_ops.linear(x, w, b, prologue, epilogue, lo)
    ok, err, tol = _close(y, ref, "forward")
    assert ok, f"forward max abs err {err:.3e} over tolerance {tol}"


@interp
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
    names = ["dX", "dW"] + (["db"] if bias else []) + (["dA", "dB"] if lora else [])
    for name, g_, r_ in zip(names, got, want):
        assert g_.dtype == torch.float32
        ok, err, tol = _close(g_, r_, name)
        assert ok, f"{name}: max abs err {err:.3e} over tolerance {tol}"


@interp
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


def _check_dw_db_fold(g, x, lens, prologue, cut, fold, assert_equal, what):
    """dW/db over ``lens`` (FP32 out) equal ``fold`` of each sample's own partials, and the micro-batches
    ``lens[cut[i]:cut[i+1]]`` continued through FP32 buffers (``accumulate_into``) give the same bytes."""
    full = G.gemm_dw(g, x, lens, prologue=prologue, out_dtype=torch.float32)
    bfull = G.gemm_db(g, lens, out_dtype=torch.float32)
    starts = [0]
    for t in lens:
        starts.append(starts[-1] + t)
    spans = list(zip(starts, starts[1:]))
    parts = [G.gemm_dw(g[a:e].contiguous(), x[a:e].contiguous(), (e - a,), prologue=prologue, out_dtype=torch.float32)
             for a, e in spans]
    bparts = [G.gemm_db(g[a:e].contiguous(), (e - a,), out_dtype=torch.float32) for a, e in spans]
    assert_equal(full, fold(parts), f"{what} dW vs fold of per-sample partials")
    assert_equal(bfull, fold(bparts), f"{what} db vs fold of per-sample partials")
    buf = torch.zeros(g.shape[1], x.shape[1], device=g.device)
    bbuf = torch.zeros(g.shape[1], device=g.device)
    for i0, i1 in zip(cut, cut[1:]):
        a, e = starts[i0], starts[i1]
        G.gemm_dw(g[a:e].contiguous(), x[a:e].contiguous(), lens[i0:i1], prologue=prologue, accumulate_into=buf)
        G.gemm_db(g[a:e].contiguous(), lens[i0:i1], accumulate_into=bbuf)
    assert_equal(buf, full, f"{what} dW micro-batch split")
    assert_equal(bbuf, bfull, f"{what} db micro-batch split")


def _assert_equal(a, b, what):
    assert torch.equal(a, b), what


@interp
@pytest.mark.parametrize("prologue", ["none", "silu"])
def test_weight_grad_is_a_sample_order_fold(prologue):
    """dW/db with seqlens (a, b, c, d) equal, in bytes, the FP32 left fold of per-sample partials and any
    micro-batch split continued through an FP32 buffer."""
    seqlens = (5, 0, 12, 20)
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(sum(seqlens), N, generator=gen)
    x = torch.randn(sum(seqlens), K, generator=gen)
    # micro-batches (5,), (0, 12), (20,)
    _check_dw_db_fold(g, x, seqlens, prologue, (0, 1, 3, 4), _fold, _assert_equal, f"prologue {prologue}")


@interp
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
    """A call with one bad argument, every tensor on the device the kernels run on (so the error is that one)."""
    dev = "cpu" if INTERPRET else "cuda"

    def put(v):
        if isinstance(v, torch.Tensor):
            return v.to(dev)
        return tuple(put(t) for t in v) if isinstance(v, tuple) else v

    w, b, lo = _params(True)
    args = dict(x=_x(M), weight=w, bias=b, seqlens=SEQLENS, prologue="none", epilogue="none", lora=lo)
    args.update(over)
    args = {k: (v if k == "seqlens" else put(v)) for k, v in args.items()}
    x = args.pop("x")
    return lambda: G.gemm(x, **args)


@interp
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
            assert impls[0].split_k is False and ident["split_k"] is False
            assert ident["config"]["keyed_by"] == "(N, K, dtype, stream)"


class _LaunchSpy:
    """Stands in for a ``@triton.jit`` kernel: records each launch's keyword (constexpr and launch-option)
    arguments, then launches the real kernel."""

    def __init__(self, name: str, kernel, log: list):
        self.name, self.kernel, self.log = name, kernel, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.name, tuple(sorted(kwargs.items()))))
            return self.kernel[grid](*args, **kwargs)

        return launch


_M_SETS = [  # (rows to compare, N, K, prologue, epilogue, LoRA): 4224 = a 1024² image's 4096 tokens + 128 text rows
    pytest.param((1, 37, 257), N, K, "silu", "gelu_tanh", True, id="m1-37-257-silu-gelu-lora"),
    pytest.param((1, 4224), 24, 16, "none", "gelu_tanh", False, id="m1-4224-gelu", marks=pytest.mark.slow),
]


@interp
@pytest.mark.parametrize("ms,n,k,prologue,epilogue,lora", _M_SETS)
def test_launch_configs_do_not_depend_on_m(ms, n, k, prologue, epilogue, lora, monkeypatch):
    """The configuration a forward + backward actually launches with is the same at every M: the keys
    ``configs`` is asked for and every constexpr / launch option of every kernel launch (the grid, which
    must cover M rows, is the only thing allowed to change). A config chosen from M anywhere on the
    launch path — in ``configs`` or in the launch code — changes a recorded launch."""
    from mmdit_strict.kernels.triton import configs

    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(n, k, generator=g).requires_grad_(), torch.randn(n, generator=g).requires_grad_()
    lo = (torch.randn(R, k, generator=g).requires_grad_(), torch.randn(n, R, generator=g).requires_grad_(), 0.5) if lora else None
    calls: list = []
    for name in ("fwd_config", "dw_config"):
        real = getattr(configs, name)
        monkeypatch.setattr(configs, name, lambda *a, _r=real, _n=name, **k: calls.append((_n, a, tuple(sorted(k.items())))) or _r(*a, **k))
    launches: list = []
    for kname in ("_gemm_fwd_kernel", "_gemm_dw_kernel", "_gemm_db_kernel", "_act_fwd_kernel", "_act_bwd_kernel"):
        monkeypatch.setattr(kernels, kname, _LaunchSpy(kname, getattr(kernels, kname), launches))
    per_m = {}
    for m in ms:
        calls.clear()
        launches.clear()
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).requires_grad_()
        y = G.gemm(x, w, b, seqlens=(m,), prologue=prologue, epilogue=epilogue, lora=lo)
        torch.autograd.grad(y, [x, w, b] + ([lo[0], lo[1]] if lora else []), torch.ones_like(y))
        assert launches and calls, "no kernel launch or config lookup was observed"
        per_m[m] = (list(calls), list(launches))
    first = per_m[ms[0]]
    for m, seen in per_m.items():
        assert seen[0] == first[0], f"config lookups at M={m} differ from M={ms[0]}: {seen[0]} vs {first[0]}"
        assert seen[1] == first[1], f"kernel launches at M={m} differ from M={ms[0]}: " + "; ".join(
            f"{a} vs {c}" for a, c in zip(seen[1], first[1]) if a != c)


@interp
@pytest.mark.parametrize("lora", [False, True])
def test_prologue_pass_equals_fused_prologue_bytes(lora, monkeypatch):
    """The SiLU prologue as its own pass (the default) and fused into the main loop give the same
    bytes, forward and every gradient: both round silu(x) once before the same dots."""
    from mmdit_strict.kernels.triton import configs

    w, b, lo = _params(lora, requires_grad=True)
    x = _x(M, seed=13, requires_grad=True)
    dy = torch.randn(M, N, generator=torch.Generator().manual_seed(17))
    inputs = [x, w, b] + ([lo[0], lo[1]] if lora else [])
    runs = []
    for mode in ("pass", "fused"):
        orig = configs.fwd_config
        monkeypatch.setattr(configs, "fwd_config", lambda n, k, dtype, stream="image", _o=orig, _m=mode: _o(n, k, dtype, stream).replace(prologue=_m))
        y = G.gemm(x, w, b, seqlens=SEQLENS, prologue="silu", epilogue="gelu_tanh", lora=lo)
        runs.append((y.detach(),) + torch.autograd.grad(y, inputs, dy))
        monkeypatch.setattr(configs, "fwd_config", orig)
    for a, c in zip(*runs):
        assert torch.equal(a, c)


@interp
def test_shared_prologue_pass_runs_once_and_keeps_bytes(monkeypatch):
    """Inside ``shared_prologues`` three products reading the same x (one with a LoRA) evaluate the SiLU pass
    once; their outputs and every gradient equal the bytes of each product running its own pass."""
    from mmdit_strict.kernels.prologues import shared_prologues
    from mmdit_strict.kernels.triton.gemm import launch

    passes: list[int] = []
    real = launch.act_fwd
    monkeypatch.setattr(launch, "act_fwd", lambda t, act: passes.append(1) or real(t, act))
    layers = [_params(lora, requires_grad=True) for lora in (False, True, False)]
    dy = torch.randn(M, N, generator=torch.Generator().manual_seed(17))

    def run(shared: bool):
        x = _x(M, seed=13, requires_grad=True)
        passes.clear()
        with shared_prologues() if shared else contextlib.nullcontext():
            ys = [G.gemm(x, w, b, seqlens=SEQLENS, prologue="silu", lora=lo) for w, b, lo in layers]
        grads = torch.autograd.grad(ys, [x] + [t for w, b, lo in layers for t in (w, b, *(lo[:2] if lo else ()))],
                                    [dy] * len(ys))
        return len(passes), [y.detach() for y in ys] + list(grads)

    (n_shared, shared), (n_own, own) = run(True), run(False)
    assert (n_shared, n_own) == (1, 3)
    for a, c in zip(shared, own):
        assert_bytes_equal(a, c, "shared SiLU pass vs one per product")


def check_gate_residual_fusion(target, m_seq, n, k, lora, dtype_rows=None) -> None:
    """``gemm_gate_residual`` gives the bytes of the unfused pair ``adaln_gate_residual(r, gemm(x, W, b, lora), gate)``
    with the gate a row-strided chunk of a (B, 6N) modulation product, as the strict block passes it."""
    from mmdit_strict.kernels.triton import norms as N

    gen = torch.Generator().manual_seed(23)
    m = sum(m_seq)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(target.device, target.dtype)

    x, res = rnd(m, k), rnd(m, n)
    w, b = rnd(n, k, scale=k ** -0.5), rnd(n)
    lo = (rnd(5, k, scale=k ** -0.5), rnd(n, 5), 0.5) if lora else None
    gate = rnd(len(m_seq), 6 * n, scale=0.5).chunk(6, dim=-1)[2]
    with torch.no_grad():
        fused = G.gemm_gate_residual(x, w, b, res, gate, seqlens=m_seq, lora=lo)
        pair = N.adaln_gate_residual(res, G.gemm(x, w, b, seqlens=m_seq, lora=lo), gate, seqlens=m_seq)
    assert_bytes_equal(fused, pair, f"fused gate residual vs the pair ({target.label}, rows {m_seq}, N {n}, lora {lora})")


@interp
@pytest.mark.parametrize("lora", [False, True])
def test_gate_residual_fusion_equals_the_pair_interpreter(lora):
    from tests.harness import CPU_FP32

    check_gate_residual_fusion(CPU_FP32, (10, 0, 27), N, K, lora)
    check_gate_residual_fusion(CPU_FP32, (1,), 16, 32, lora)


@interp
def test_gate_residual_fusion_refuses_bad_calls():
    w, b, _ = _params(False)
    x = _x(M)
    res, gate = torch.zeros(M, N), torch.zeros(len(SEQLENS), N)
    with pytest.raises(ValueError, match="forward only"):
        G.gemm_gate_residual(x.requires_grad_(True), w, b, res, gate, seqlens=SEQLENS)
    x = _x(M)
    with pytest.raises(ValueError, match="gate of shape"):
        G.gemm_gate_residual(x, w, b, res, gate[:2], seqlens=SEQLENS)
    with pytest.raises(ValueError, match="unit column stride"):
        G.gemm_gate_residual(x, w, b, res, torch.zeros(N, len(SEQLENS)).t(), seqlens=SEQLENS)
    with pytest.raises(ValueError, match="residual"):
        G.gemm_gate_residual(x, w, b, res[:, :-1], gate, seqlens=SEQLENS)


@interp
def test_gate_residual_fusion_is_offered_only_when_asked():
    """Off by default (GATE_RESIDUAL_FUSION); offer_gate_residual_fusion adds it to the triton entries of the two
    products followed by a gated residual, and only to those, and withdraws it."""
    from mmdit_strict.kernels.registry import implementations

    def offered() -> set[str]:
        return {i.op for i in implementations() if i.backend == "triton" and "adaln_gate_residual" in i.fusions}

    assert G.autograd.GATE_RESIDUAL_FUSION is False and offered() == set()
    G.offer_gate_residual_fusion(True)
    try:
        assert offered() == {"attn_out_bias_gemm", "mlp_down_gemm"}
    finally:
        G.offer_gate_residual_fusion(False)
    assert offered() == set()


def test_activation_codes_agree_between_host_and_kernels():
    """The host's ``Act`` codes and the kernels' ``tl.constexpr`` mirrors are the same numbers."""
    from mmdit_strict.kernels.triton.gemm import codes

    for act in codes.Act:
        assert getattr(codes, f"ACT_{act.name}").value == int(act), act
    assert set(G.PROLOGUES.values()) | set(G.EPILOGUES.values()) < set(codes.Act)


def test_prepacked_copy_is_owned_by_the_weight():
    """The ``Wᵀ`` copy lives on the weight: reused while the weight is unchanged, rebuilt after an
    in-place update, dropped on request and freed with the weight (no module-level cache)."""
    import gc
    import weakref

    w = torch.randn(N, K)
    p1 = G.prepacked_weight(w)
    assert G.prepacked_weight(w) is p1 and torch.equal(p1, w.t()) and p1.is_contiguous()
    assert G.prepacked_bytes([w, torch.randn(3)]) == N * K * 4
    w.add_(1.0)  # optimizer-step-like in-place update: a new version
    p2 = G.prepacked_weight(w)
    assert p2 is not p1 and torch.equal(p2, w.t())
    G.drop_prepacked(w)
    assert G.prepacked_bytes([w]) == 0
    p3 = weakref.ref(G.prepacked_weight(w))
    del w
    gc.collect()
    assert p3() is None, "the prepacked copy outlived its weight"


@interp
@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("prologue,epilogue,lora", [("none", "gelu_tanh", True), ("silu", "silu", False)])
def test_weight_read_in_place_gives_the_prepacked_bytes(tma, prologue, epilogue, lora, monkeypatch):
    """``weight_layout="nk"`` (W (N, K) as stored: tensor-descriptor boxes transposed before the dot, or
    strided loads) and ``"kn"`` (the weight's own ``Wᵀ`` copy) feed the same values to the same dots
    of the same tiles: identical forward bytes, and the in-place read makes no copy."""
    from mmdit_strict.kernels.triton import configs

    n, k = 44, 52  # 16-byte row strides (the copy engine's rule), still no multiple of any tile
    g = torch.Generator().manual_seed(31)
    w, b, x = torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g), torch.randn(M, k, generator=g)
    lo = (torch.randn(R, k, generator=g) / k**0.5, torch.randn(n, R, generator=g), 0.5) if lora else None
    launches: list = []
    monkeypatch.setattr(kernels, "_gemm_fwd_kernel", _LaunchSpy("fwd", kernels._gemm_fwd_kernel, launches))
    base = configs.FwdConfig(16, 32, 16, 4, 2, tma=tma)
    kw = dict(prologue=prologue, epilogue=epilogue, lora=lo)
    y_kn = G.gemm_fwd(x, w, b, config=base.replace(weight_layout="kn"), **kw)[0]
    assert G.prepacked_bytes([w]) == n * k * 4
    G.drop_prepacked(w)
    y_nk = G.gemm_fwd(x, w, b, config=base.replace(weight_layout="nk"), **kw)[0]
    assert G.prepacked_bytes([w]) == 0, "the in-place read made a copy of the weight"
    specs = [dict(k)["CFG"] for _, k in launches]
    main = [s for s in specs if s.BLOCK_N == 32]  # the layer's product (the LoRA u product is narrower)
    assert [(s.USE_TMA, s.W_NK) for s in main] == [(tma, False), (tma, tma)]
    assert torch.equal(y_kn, y_nk)


import triton.language as tl  # noqa: E402


@triton.jit
def _act_kernel(z_ptr, out_ptr, size, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    tl.store(out_ptr + offs, fpmath._act_f32(tl.load(z_ptr + offs, mask=mask, other=0.0), ACT), mask=mask)


@triton.jit
def _div_kernel(n_ptr, d_ptr, q_ptr, size, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    n = tl.load(n_ptr + offs, mask=mask, other=1.0)
    d = tl.load(d_ptr + offs, mask=mask, other=1.0)
    tl.store(q_ptr + offs, fpmath._div_ge1_f32(n, d), mask=mask)


_VARIANTS = {  # launch variants that must not move a single byte (configs.FwdConfig fields)
    "persistent": dict(persistent=True),
    "split2": dict(epi_split=2),
    "split4+persistent": dict(epi_split=4, persistent=True),
}


@interp
@pytest.mark.parametrize("variant", sorted(_VARIANTS))
@pytest.mark.parametrize("prologue,epilogue,lora", [("none", "gelu_tanh", False), ("silu", "silu", True)])
def test_launch_variants_give_the_same_bytes(variant, prologue, epilogue, lora, monkeypatch):
    """A persistent tile walk and epilogue column parts leave the forward and every gradient
    byte-identical to the plain one-program-per-tile launch (tiles 16×64×16: 3 row tiles,
    programs walk several tiles each, parts of 32 and 16 columns)."""
    from mmdit_strict.kernels.triton import configs

    w, b, lo = _params(lora, requires_grad=True)
    x = _x(M, seed=19, requires_grad=True)
    dy = torch.randn(M, N, generator=torch.Generator().manual_seed(23))
    inputs = [x, w, b] + ([lo[0], lo[1]] if lora else [])
    runs = []
    for extra in ({}, _VARIANTS[variant]):
        monkeypatch.setattr(configs, "fwd_config", lambda n, k, dtype, stream="image", _e=extra: configs.FwdConfig(16, 64, 16, 4, 2, **_e))
        y = G.gemm(x, w, b, seqlens=SEQLENS, prologue=prologue, epilogue=epilogue, lora=lo)
        runs.append((y.detach(),) + torch.autograd.grad(y, inputs, dy))
    for a, c in zip(*runs):
        assert torch.equal(a, c)


@interp
@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
def test_activation_matches_fp64(act):
    """The epilogue activations (clamped exp, Newton division) against FP64 math on 65 536 inputs
    spanning both tails, under ``tolerances.yaml activation.<act>.fp32``."""
    from mmdit_strict.tolerances import tolerance

    g = torch.Generator().manual_seed(5)
    size = 1 << 16
    z = torch.cat([torch.randn(size // 2, generator=g) * 3, (torch.rand(size // 2, generator=g) - 0.5) * 240])
    z[:6] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0])
    out = torch.empty_like(z)
    _act_kernel[(size // 1024,)](z, out, size, ACT=int(G.EPILOGUES[act]), BLOCK=1024)
    zd = z.double()
    if act == "gelu_tanh":
        ref = 0.5 * zd * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (zd + 0.044715 * zd**3)))
    else:
        ref = zd * torch.sigmoid(zd)
    ok, max_abs, _ = tolerance("activation", act, torch.float32).check(out.double(), ref)
    assert ok, max_abs
    assert torch.equal(out[:2].view(torch.int32), z[:2].view(torch.int32))  # act(±0) = ±0


@interp
def test_newton_division_is_correctly_rounded():
    """``_div_ge1_f32`` equals IEEE division (numpy's FP32 ``/`` rounds correctly) on d in [1, e⁸⁶]
    (the activations' range), signed zeros included."""

    g = torch.Generator().manual_seed(3)
    size = 1 << 16
    d = torch.cat([1 + torch.rand(size // 4, generator=g) * 1e-3, 1 + torch.rand(size // 4, generator=g) * 4,
                   torch.exp(torch.rand(size // 2, generator=g) * 86.0)])
    d[-4:] = torch.tensor([1.0, 2.0, 3.0, 2.0**124])
    n = torch.randn(size, generator=g) * 10
    n[:8] = torch.tensor([0.0, -0.0, 1.0, -1.0, 3e-38, -3e-38, 1e30, -7.0])
    q = torch.empty_like(n)
    _div_kernel[(size // 1024,)](n, d, q, size, BLOCK=1024)
    want = torch.from_numpy(n.numpy() / d.numpy())
    assert torch.equal(q.view(torch.int32), want.view(torch.int32))



# ------------------------------------------------------------------------------------------------
# GPU: the real layer classes in bf16 and fp32 through the shared harness (never in CI)
# ------------------------------------------------------------------------------------------------

from tests.harness import (  # noqa: E402
    BATCH_SIZES,
    check_grad_accuracy,
    check_param_grad_fold,
    check_row_invariance,
    check_token_sweep,
    generator,
    packed_op,
    randn,
    rows_op,
    run_with_grads,
)

# (name, N, K, prologue, epilogue, LoRA rank): modulation (SiLU prologue, one row per sample),
# mlp_up (bias + tanh-GELU), attn_out with a LoRA.
GPU_LAYERS = [
    ("mod", 18432, 3072, "silu", "none", 0),
    ("mlp_up", 12288, 3072, "none", "gelu_tanh", 0),
    ("attn_out+lora", 3072, 3072, "none", "none", 16),
]
GPU_TOKENS = (1, 7, 33, 100, 129, 300)  # non-multiples of every BLOCK_M (16/128/256) on both sides
GPU_FOLD_LENS = (7, 1, 129, 300, 32)


def _layer_params(n, k, r, target, seed=21):
    g = generator(seed)
    w = randn(n, k, gen=g, target=target, scale=k**-0.5)
    b = randn(n, gen=g, target=target, scale=0.1)
    lora = None
    if r:
        lora = (randn(r, k, gen=g, target=target, scale=k**-0.5), randn(n, r, gen=g, target=target, scale=r**-0.5), 0.5)
    return w, b, lora


def _ids(layers):
    return [l[0] for l in layers]


@on_gpu_targets
@pytest.mark.parametrize("layer", GPU_LAYERS, ids=_ids(GPU_LAYERS))
def test_gpu_row_invariance(target, layer):
    """y and dX rows: a batch of B ∈ {2, 3, 64, 257} rows equals each row alone (every position, reversed, probe)."""
    skip_unless_compiled(target)
    name, n, k, pro, epi, r = layer
    w, b, lo = _layer_params(n, k, r, target)

    def fn(x, gy):
        out, grads = run_with_grads(
            lambda x: G.gemm(x, w, b, seqlens=(x.shape[0],), prologue=pro, epilogue=epi, lora=lo), [x], gy, [0])
        return out, grads[0]

    check_row_invariance(rows_op(fn), lambda gen: (randn(k, gen=gen), randn(n, gen=gen)), BATCH_SIZES,
                         target=target, what=f"triton gemm {name} {target.label} (y, dX)")


@on_gpu_targets
@pytest.mark.parametrize("layer", GPU_LAYERS[1:], ids=_ids(GPU_LAYERS[1:]))
def test_gpu_token_sweep(target, layer):
    """Samples of 1..300 tokens batched together (and reversed) equal each alone; a sample's first n rows alone
    equal the same rows inside the longest sample (y, dX)."""
    skip_unless_compiled(target)
    name, n, k, pro, epi, r = layer
    w, b, lo = _layer_params(n, k, r, target)

    def fn(x, gy, seqlens):
        out, grads = run_with_grads(lambda x: G.gemm(x, w, b, seqlens=seqlens, prologue=pro, epilogue=epi, lora=lo), [x], gy, [0])
        return out, grads[0]

    check_token_sweep(packed_op(fn), lambda t, gen: (randn(t, k, gen=gen), randn(t, n, gen=gen)), GPU_TOKENS,
                      target=target, row_local=True, what=f"triton gemm {name} {target.label}")


@on_gpu_targets
@pytest.mark.parametrize("layer", GPU_LAYERS, ids=_ids(GPU_LAYERS))
def test_gpu_grad_accuracy(target, layer):
    """Forward and each gradient (dX, dW, db, dA, dB) against the FP64 reference within tolerances.yaml
    ``gemm.<check>.<dtype>`` (``atol_max``: a fraction of that tensor's max|ref|), with cuBLAS + eager
    epilogue kept out of the pass rule (the bench reports the flash-attention "≤ 2× torch error" column)."""
    skip_unless_compiled(target)
    name, n, k, pro, epi, r = layer
    w, b, lo = _layer_params(n, k, r, target, seed=23)
    seqlens = (1, 3, 60) if pro == "silu" else (45, 83)
    x = randn(sum(seqlens), k, gen=generator(24))
    inputs = [x, w, b] + ([lo[0], lo[1]] if lo else [])
    checks = ["dX", "dW", "db"] + (["dA", "dB"] if lo else [])

    def fn(x, w, b, *l):
        return G.gemm(x, w, b, seqlens=seqlens, prologue=pro, epilogue=epi, lora=(l[0], l[1], 0.5) if l else None)

    def rf(x, w, b, *l):
        return ref_ops.linear(x, w, b, pro, epi, (l[0], l[1], 0.5) if l else None)

    gy = randn(sum(seqlens), n, gen=generator(25), target=target)
    ref_in = [target.put(t).detach().to("cpu", torch.float64) for t in inputs]
    ref_out, ref_grads = run_with_grads(rf, ref_in, gy.detach().to("cpu", torch.float64), list(range(len(inputs))))
    for i, check in enumerate(checks):
        tol = {"fwd": gemm_tolerance("forward", target.dtype, ref_out), "grad": gemm_tolerance(check, target.dtype, ref_grads[i])}
        check_grad_accuracy(fn, rf, inputs, tol, target=target, grad_out=gy, wrt=[i],
                            what=f"triton gemm {name} {target.label} {check}")


@pytest.mark.gpu
@pytest.mark.parametrize("layer", GPU_LAYERS, ids=_ids(GPU_LAYERS))
def test_gpu_param_grad_fold(layer):
    """FP32: dW/db (and LoRA dA/dB) of a batch equal, in bytes, the sample-order left fold of each sample alone.
    (In bf16 the engine folds FP32 partials and casts once, so a fold of bf16 singleton gradients is not
    the contract; :func:`test_gpu_bf16_weight_grad_fold_of_fp32_partials` checks the bf16 form.)"""
    target = GPU_TARGETS[1]
    skip_unless_compiled(target)
    name, n, k, pro, epi, r = layer
    w, b, lo = _layer_params(n, k, r, target, seed=27)
    lens = (1,) * 9 if pro == "silu" else GPU_FOLD_LENS
    gen = generator(28)
    items = [randn(t, k, gen=gen, target=target) for t in lens]
    gouts = [randn(t, n, gen=gen, target=target) for t in lens]

    def fn(batch, params):
        seq = tuple(t.shape[0] for t in batch)
        lora = (params[2], params[3], 0.5) if lo else None
        out = G.gemm(torch.cat(batch), params[0], params[1], seqlens=seq, prologue=pro, epilogue=epi, lora=lora)
        return list(out.split(list(seq)))

    params = [w, b] + ([lo[0], lo[1]] if lo else [])
    check_param_grad_fold(fn, items, params, gouts, what=f"triton gemm {name} {target.label} dW/db/dA/dB")


@pytest.mark.gpu
@pytest.mark.parametrize("layer", GPU_LAYERS[:2], ids=_ids(GPU_LAYERS[:2]))
def test_gpu_bf16_weight_grad_fold_of_fp32_partials(layer):
    """BF16: dW/db over seqlens equal, in bytes, the sample-order left fold of the per-sample FP32 partials, and a
    micro-batch split continued through FP32 buffers."""
    target = GPU_TARGETS[0]
    skip_unless_compiled(target)
    from tests.harness import assert_bytes_equal, left_fold

    name, n, k, pro, epi, _ = layer
    lens = (1,) * 9 if pro == "silu" else GPU_FOLD_LENS
    gen = generator(29)
    x = randn(sum(lens), k, gen=gen, target=target)
    g = randn(sum(lens), n, gen=gen, target=target)
    _check_dw_db_fold(g, x, lens, pro, (0, 2, len(lens) - 1, len(lens)), left_fold, assert_bytes_equal, f"{name} bf16")


@on_gpu_targets
@pytest.mark.parametrize("k", [3072, 12288], ids=["attn_out", "mlp_down"])
def test_gpu_gate_residual_fusion_equals_the_pair(target, k):
    """At Qwen-Image's widths, both streams' tiles, with and without the LoRA term (BF16: the product rounded
    once before the gated residual, as the unfused pair stores it)."""
    from mmdit_strict.kernels.streams import gemm_stream

    skip_unless_compiled(target)
    for stream, seq in (("image", (4096, 1, 0, 77)), ("text", (128, 77, 0, 1))):
        with gemm_stream(stream):
            for lora in (False, True):
                check_gate_residual_fusion(target, seq, 3072, k, lora)

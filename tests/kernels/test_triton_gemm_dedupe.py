"""Triton ``gemm_bwd`` with a deposit (a grad sink active): the weight and bias products run once, per
sample, and the returned dW, db, dA, dB are those partials folded — the same raw bytes as ``gemm_dw`` /
``gemm_db`` (what ``gemm_bwd`` returns without a deposit), and the deposited partials are those of
``gemm_dw_samples`` / ``gemm_db_samples``.

Interpreter (CPU, FP32): tiny odd shapes, one and three samples (one of them empty), LoRA scale 1.0 and
0.5. GPU (``-m gpu``, BF16 and FP32): a Qwen-like layer, 3072 inputs, 64 or 3072 outputs, rank 64, one
to three samples of about 300 rows, scale 1.0, 2.0 and 0.37 (not a power of two: its product rounds, so
a fold that contracted ``acc + scale·part`` to an FMA would show).
GPU command: ``python -m pytest -q -m gpu tests/kernels/test_triton_gemm_dedupe.py``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.harness import Target, generator, randn  # noqa: E402
from tests.kernels.triton_rows import G, interp, on_gpu_targets, skip_unless_compiled  # noqa: E402  (mode: tests/conftest.py)

from mmdit_strict.kernels.triton.gemm import launch as L  # noqa: E402

NAMES = ("dx", "dW", "db", "dA", "dB")


def assert_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
    width = {4: torch.int32, 2: torch.int16}[a.element_size()]
    same = torch.equal(a.detach().contiguous().view(width), b.detach().contiguous().view(width))
    if not same:
        diff = (a.double() - b.double()).abs()
        raise AssertionError(f"{what}: bits differ at {int((a.view(width) != b.view(width)).sum())} elements "
                             f"(max abs diff {float(diff.max()):.3e})")


class _Deposits:
    """A ``deposit`` callback that keeps a copy of each deposit, then writes into the handed partials (the
    sink takes them over with ``transfer=True`` and may add into them in place)."""

    def __init__(self) -> None:
        self.got: dict[int, list[torch.Tensor]] = {}
        self.storages: set[int] = set()

    def __call__(self, i: int, partials: list[torch.Tensor]) -> None:
        assert i not in self.got
        self.got[i] = [p.clone() for p in partials]
        for p in partials:
            assert p.dtype == torch.float32
            self.storages.add(p.untyped_storage().data_ptr())
            p.fill_(float("nan"))


def _check(target: Target, k: int, n: int, r: int, seqlens: tuple[int, ...], scale: float, prologue: str,
           epilogue: str, seed: int = 0) -> None:
    g = generator(seed)
    m = sum(seqlens)
    x = randn(m, k, gen=g, target=target)
    w = randn(n, k, gen=g, target=target, scale=k**-0.5)
    b = randn(n, gen=g, target=target, scale=0.1)
    a = randn(r, k, gen=g, target=target, scale=k**-0.5)
    bl = randn(n, r, gen=g, target=target, scale=r**-0.5)
    dy = randn(m, n, gen=g, target=target)
    lora = (a, bl, scale)
    _, pre, u, h = G.gemm_fwd(x, w, b, prologue=prologue, epilogue=epilogue, lora=lora, store_pre=True, return_h=True)
    kw = dict(seqlens=seqlens, prologue=prologue, epilogue=epilogue, pre=pre, lora=lora, u=u, h=h)
    want = G.gemm_bwd(dy, x, w, **kw)  # no deposit: gemm_dw / gemm_db
    dep = _Deposits()
    got = G.gemm_bwd(dy, x, w, **kw, deposit=dep)
    for name, t_got, t_want in zip(NAMES, got, want):
        assert_bits(t_got, t_want, f"{target.label} {seqlens} scale {scale} {name}: with a deposit vs without")
    assert sorted(dep.got) == [1, 2, 3, 4]
    for name, t in zip(NAMES[1:], got[1:]):
        assert t.untyped_storage().data_ptr() not in dep.storages, f"{name} shares storage with a deposited partial"
    # the deposits are the per-sample launches' partials, and the returned gradients gemm_dw's / gemm_db's
    if epilogue == "none" and prologue == "none":
        ref = {1: L.gemm_dw_samples(dy, x, seqlens), 2: L.gemm_db_samples(dy, seqlens),
               4: L.gemm_dw_samples(dy, u, seqlens, scale=scale)}
        for i, parts in ref.items():
            assert len(dep.got[i]) == len(seqlens)
            for s, (p_got, p_ref) in enumerate(zip(dep.got[i], parts)):
                assert_bits(p_got, p_ref, f"{target.label} {NAMES[i]} partial {s}")
        assert_bits(got[1], G.gemm_dw(dy, x, seqlens), f"{target.label} dW vs gemm_dw")
        assert_bits(got[2], G.gemm_db(dy, seqlens), f"{target.label} db vs gemm_db")
        assert_bits(got[4], G.gemm_dw(dy, u, seqlens, scale=scale), f"{target.label} dB vs gemm_dw")


@interp
@pytest.mark.parametrize("scale", [1.0, 0.5])
@pytest.mark.parametrize("seqlens", [(13,), (5, 0, 20)], ids=["S1", "S3"])
@pytest.mark.parametrize("prologue,epilogue", [("none", "none"), ("silu", "gelu_tanh")])
def test_gemm_bwd_with_a_deposit_returns_gemm_dw_bytes_interpreter(seqlens, scale, prologue, epilogue) -> None:
    # K, N, r non-multiples of every tile; 20 rows: more than one 16-row dW chunk
    _check(Target("cpu", torch.float32), 21, 19, 3, seqlens, scale, prologue, epilogue)


@interp
def test_fold_partials_is_a_new_tensor_of_the_sample_order_fold() -> None:
    g = generator(3)
    parts = [torch.randn(7, 5, generator=g) * torch.exp2(torch.randint(-20, 20, (7, 5), generator=g).float())
             for _ in range(4)]
    parts[1][0, 0] = -0.0
    for count in (1, 2, 4):
        ps = parts[:count]
        seq = ps[0].clone()
        for p in ps[1:]:
            seq = seq + p
        for dtype in (torch.float32, torch.bfloat16):
            before = [p.clone() for p in ps]
            out = L._fold_partials(ps, dtype)
            assert all(out.untyped_storage().data_ptr() != p.untyped_storage().data_ptr() for p in ps)
            assert_bits(out, seq.to(dtype), f"{count} partials → {dtype}")
            for p, q in zip(ps, before):
                assert_bits(p, q, "a partial was written")


@on_gpu_targets
@pytest.mark.parametrize("scale", [1.0, 2.0, 0.37])
@pytest.mark.parametrize("seqlens", [(600,), (300, 300), (257, 1, 342)], ids=["S1", "S2", "S3"])
@pytest.mark.parametrize("n", [64, 3072])
def test_gpu_gemm_bwd_with_a_deposit_returns_gemm_dw_bytes(target: Target, n: int, seqlens, scale: float) -> None:
    skip_unless_compiled(target)
    _check(target, 3072, n, 64, seqlens, scale, "none", "none", seed=n)


@on_gpu_targets
@pytest.mark.parametrize("seqlens", [(300, 300)], ids=["S2"])
def test_gpu_gemm_bwd_with_a_deposit_prologue_epilogue(target: Target, seqlens) -> None:
    skip_unless_compiled(target)
    _check(target, 3072, 3072, 64, seqlens, 0.37, "silu", "gelu_tanh", seed=1)

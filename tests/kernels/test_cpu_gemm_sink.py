"""CPU strict GEMM backward with a grad sink: each per-sample product is computed once, handed to the
sink (``transfer=True``) and folded for the returned gradient — the same bytes as without a sink.

Checked in raw bits (``-0.0`` and ``+0.0`` differ): the returned gradients with a sink active against
the same backward without one, and against :func:`~mmdit_strict.kernels.cpu.primitives.fold` of the
deposited partials; each deposited partial against that sample's own gradient computed alone; and the
returned gradient never shares storage with a partial the sink may add into.
"""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.kernels.cpu import gemm as cpu_gemm
from mmdit_strict.kernels.cpu.primitives import fold
from mmdit_strict.kernels.grad_sink import SampleGradSink, collect_sample_grads, sample_keys
from tests.harness import generator

K, N, R = 23, 19, 16  # not rank 4: MKL bmm with 4 output columns rounds a row by its position in the tile here
SEQLENS = {1: (11,), 3: (9, 40, 6)}  # 40 rows: more than one 32-row forward tile


def assert_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
    width = {4: torch.int32, 2: torch.int16}[a.element_size()]
    same = torch.equal(a.detach().contiguous().view(width), b.detach().contiguous().view(width))
    assert same, f"{what}: bits differ (max abs diff {float((a.double() - b.double()).abs().max()):.3e})"


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Recorder:
    """A stand-in sink for :func:`cpu_gemm._per_sample_outer`: keeps copies of what it was handed, then
    writes into the handed tensors when they were transferred (as a sink that owns them may)."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, tuple, list[torch.Tensor], bool, list[int]]] = []

    def add(self, param, keys, partials, *, transfer: bool = False) -> None:
        self.calls.append((param, tuple(keys), [p.clone() for p in partials], transfer, [_storage(p) for p in partials]))
        if transfer:
            for p in partials:
                p.fill_(float("nan"))


@pytest.mark.parametrize("samples", [1, 3])
def test_per_sample_outer_folds_the_partials_it_deposits(samples: int) -> None:
    seqlens = SEQLENS[samples]
    g = generator(5)
    dz = torch.randn(sum(seqlens), N, generator=g)
    x = torch.randn(sum(seqlens), K, generator=g) * torch.exp2(torch.randint(-8, 8, (sum(seqlens), K), generator=g).float())
    want = cpu_gemm._per_sample_outer(dz, x, seqlens)  # no sink
    rows = torch.split(torch.arange(sum(seqlens)), list(seqlens))
    products = [dz[r].t().contiguous() @ x[r].contiguous() for r in rows]  # each sample alone: the fold's terms
    assert_bits(want, fold(torch.stack(products)), "no-sink fold vs primitives.fold of the one-sample products")

    rec, param, keys = _Recorder(), torch.zeros(N, K), [f"s{i}" for i in range(samples)]
    got = cpu_gemm._per_sample_outer(dz, x, seqlens, rec, param, keys)
    assert_bits(got, want, "returned gradient with a sink vs without")  # after the sink wrote into its partials
    (p, ks, parts, transfer, storages), = rec.calls
    assert p is param and ks == tuple(keys) and transfer
    assert _storage(got) not in storages, "the returned gradient shares storage with a transferred partial"
    for i, (part, prod) in enumerate(zip(parts, products)):
        assert_bits(part, prod, f"deposited partial {i} vs that sample's product")


class _RecordingSink(SampleGradSink):
    """A real sink that also keeps a copy of each deposit, in arrival order."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[int, tuple, list[torch.Tensor], bool]] = []

    def add(self, param, keys, partials, *, transfer: bool = False) -> None:
        self.log.append((id(param), tuple(keys), [p.clone() for p in partials], transfer))
        super().add(param, keys, partials, transfer=transfer)


def _layer(scale: float):
    g = generator(7)
    w = (torch.randn(N, K, generator=g) / K**0.5).requires_grad_(True)
    b = torch.randn(N, generator=g).requires_grad_(True)
    a = (torch.randn(R, K, generator=g) / K**0.5).requires_grad_(True)
    bl = torch.randn(N, R, generator=g).requires_grad_(True)
    return {"W": w, "b": b, "A": a, "B": bl}, scale


def _backward(params, scale, x, gy, seqlens, prologue, epilogue) -> dict[str, torch.Tensor]:
    for p in params.values():
        p.grad = None
    y = cpu_gemm.gemm(x, params["W"], params["b"], seqlens=seqlens, prologue=prologue, epilogue=epilogue,
                      lora=(params["A"], params["B"], scale))
    (y * gy).sum().backward()
    grads = {name: p.grad for name, p in params.items()}
    for p in params.values():
        p.grad = None
    return grads


@pytest.mark.parametrize("mode", ["stored", "streamed"])
@pytest.mark.parametrize("scale", [1.0, 0.5])
@pytest.mark.parametrize("samples", [1, 3])
@pytest.mark.parametrize("prologue,epilogue", [("none", "none"), ("silu", "gelu_tanh")])
def test_backward_with_a_sink_returns_the_same_bytes(samples: int, scale: float, mode: str, prologue: str,
                                                     epilogue: str) -> None:
    seqlens = SEQLENS[samples]
    params, scale = _layer(scale)
    g = generator(8)
    x = torch.randn(sum(seqlens), K, generator=g)
    gy = torch.randn(sum(seqlens), N, generator=g)
    plain = _backward(params, scale, x, gy, seqlens, prologue, epilogue)
    keys = [f"s{i}" for i in range(samples)]
    sink = _RecordingSink(keys) if mode == "streamed" else _RecordingSink()
    with collect_sample_grads(sink), sample_keys(keys):
        with_sink = _backward(params, scale, x, gy, seqlens, prologue, epilogue)
    sink.done(keys)
    by_param = {pid: (ks, parts, transfer) for pid, ks, parts, transfer in sink.log}
    assert len(by_param) == len(sink.log) == 4
    rows = torch.split(torch.arange(sum(seqlens)), list(seqlens))
    alone = [_backward(params, scale, x[r], gy[r], (len(r),), prologue, epilogue) for r in rows]
    for name, p in params.items():
        assert_bits(with_sink[name], plain[name], f"{name}: gradient with a sink vs without")
        ks, parts, transfer = by_param[id(p)]
        assert ks == tuple(keys) and transfer == (name != "b")
        # the returned gradient is the sample-order fold of exactly the deposited partials
        assert_bits(with_sink[name], fold(torch.stack(parts)), f"{name}: gradient vs fold of its deposits")
        for i, part in enumerate(parts):
            assert_bits(part, alone[i][name], f"{name}: deposited partial {i} vs the sample's own gradient")
        if samples == 1:
            assert_bits(sink.fold(p), alone[0][name], f"{name}: one-key sink fold")

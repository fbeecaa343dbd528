"""Triton GEMM backward → grad sink: LoRA gradients are the same bytes for every micro-batch split.

Eight samples, each with a conditional and a negative branch (sample keys ``(sample_id, branch)``),
run through LoRA layers in shuffled micro-batches of 1, 2 and 4 samples, CFG batched (both branches in
one forward) or sequential (one forward per branch), into a stored or a streamed sink. Every layout must
give the same folded LoRA gradient bytes, equal to the tree fold, over the sorted keys, of each
(sample, branch) partial computed alone — which, cast to the execution dtype, is that sample's plain
autograd gradient.

Interpreter (CPU, FP32): samples hold whole 16-row tiles, because the interpreter's forward (numpy
matmul) is row-invariant by whole tiles only (``test_triton_gemm.py``); two chained layers, so the
second layer's dX feeds the first. GPU (``-m gpu``, FP32 and BF16): odd sample lengths, one layer.
GPU command: ``python -m pytest -q -m gpu tests/kernels/test_triton_gemm_sink.py``.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

pytest.importorskip("triton")

from mmdit_strict.kernels.grad_sink import (
    SampleGradSink,
    collect_sample_grads,
    sample_keys,
)
from tests.harness import Target, assert_bytes_equal, generator, randn
from tests.kernels.test_fold_tree import tree_reference
from tests.kernels.triton_rows import G, interp, skip_unless_compiled  # (mode: tests/conftest.py)

# (micro-batch samples, shuffle seed, CFG layout, sink): every row must give the same bytes. The interpreter
# runs the first three (each kernel launch costs it ~20 ms), the GPU all of them.
LAYOUTS = [
    (1, 0, "sequential", "stored"),
    (2, 1, "batched", "streamed"),
    (4, 2, "sequential", "streamed"),
    (2, 3, "sequential", "stored"),
    (4, 4, "batched", "stored"),
    (1, 5, "batched", "streamed"),
]


class _Net:
    """LoRA layers on the Triton GEMM: layer 0 bias + ``epilogue``, layer 1 (optional) SiLU prologue, no bias."""

    def __init__(self, dims: tuple[int, ...], rank: int, target: Target, epilogue: str = "gelu_tanh") -> None:
        g = generator(31)
        self.layers = []
        for i, (k, n) in enumerate(itertools.pairwise(dims)):
            w = randn(n, k, gen=g, target=target, scale=k**-0.5)
            b = randn(n, gen=g, target=target, scale=0.1) if i == 0 else None
            a = randn(rank, k, gen=g, target=target, scale=k**-0.5).requires_grad_(True)
            bl = randn(n, rank, gen=g, target=target, scale=rank**-0.5).requires_grad_(True)
            self.layers.append((w, b, a, bl, 0.5 if i == 0 else 2.0, "none" if i == 0 else "silu",
                                epilogue if i == 0 else "none"))
        self.params = {f"{n}{i}": t for i, (_, _, a, bl, *_rest) in enumerate(self.layers) for n, t in (("A", a), ("B", bl))}

    def __call__(self, x: torch.Tensor, seqlens: tuple[int, ...]) -> torch.Tensor:
        for w, b, a, bl, scale, pro, epi in self.layers:
            x = G.gemm(x, w, b, seqlens=seqlens, prologue=pro, epilogue=epi, lora=(a, bl, scale))
        return x


def _data(lens: tuple[int, ...], k: int, n: int, target: Target):
    """Per (sample, branch): input rows and upstream gradient rows."""
    g = generator(32)
    xs = {(s, br): randn(t, k, gen=g, target=target) for s, t in enumerate(lens) for br in (0, 1)}
    gys = {(s, br): randn(t, n, gen=g, target=target) for s, t in enumerate(lens) for br in (0, 1)}
    return xs, gys


def _sink_grads(net: _Net, xs, gys, lens, per_batch: int, seed: int, layout: str, mode: str) -> dict[str, torch.Tensor]:
    keys = sorted(xs)
    order = list(range(len(lens)))
    random.Random(seed).shuffle(order)
    batches = [order[i:i + per_batch] for i in range(0, len(order), per_batch)]
    sink = SampleGradSink(keys) if mode == "streamed" else SampleGradSink()
    with collect_sample_grads(sink):
        for mb in batches:
            groups = [[(s, 0) for s in mb] + [(s, 1) for s in mb]] if layout == "batched" else [[(s, br) for s in mb] for br in (0, 1)]
            loss = 0
            for ks in groups:
                with sample_keys(ks):
                    y = net(torch.cat([xs[k] for k in ks]), tuple(lens[s] for s, _ in ks))
                loss = loss + (y.float() * torch.cat([gys[k] for k in ks]).float()).sum()
            loss.backward()
            sink.done([k for ks in groups for k in ks])
    folded = {name: sink.fold(p) for name, p in net.params.items()}
    for p in net.params.values():
        p.grad = None
    missing = [name for name, f in folded.items() if f is None]
    assert not missing, f"the Triton backward deposited no per-sample partials for {missing}"
    return folded


def _alone(net: _Net, xs, gys, lens) -> dict:
    """Per (sample, branch), one sample per forward: ``(autograd gradient, the sink's partial)`` of each LoRA tensor."""
    out = {}
    for (s, br), x in xs.items():
        with collect_sample_grads() as sink:
            with sample_keys([(s, br)]):
                y = net(x, (lens[s],))
            (y.float() * gys[s, br].float()).sum().backward()
        out[s, br] = {name: (p.grad, sink.fold(p)) for name, p in net.params.items()}
        for p in net.params.values():
            p.grad = None
    return out


def _check(target: Target, dims: tuple[int, ...], rank: int, lens: tuple[int, ...], layouts: list,
           epilogue: str = "gelu_tanh") -> None:
    net = _Net(dims, rank, target, epilogue)
    xs, gys = _data(lens, dims[0], dims[-1], target)
    runs = {lay: _sink_grads(net, xs, gys, lens, *lay) for lay in layouts}
    first = runs[layouts[0]]
    for lay, got in runs.items():
        for name in first:
            assert_bytes_equal(got[name], first[name], f"{target.label} LoRA {name}: {lay} vs {layouts[0]}")
    alone = _alone(net, xs, gys, lens)
    for name, f in first.items():
        assert f.dtype == torch.float32 and f.shape == net.params[name].shape and float(f.abs().max()) > 0
        for k, per in alone.items():
            # a one-sample backward computes 0 + P_s and casts it once: the sample's own partial, cast
            assert_bytes_equal(per[name][1].to(target.dtype), per[name][0], f"{target.label} {k} {name}: partial vs autograd")
        assert_bytes_equal(f, tree_reference([alone[k][name][1] for k in sorted(alone)]),
                           f"{target.label} LoRA {name} vs the sorted-key fold of one-sample partials")


@interp
@pytest.mark.slow
def test_lora_grads_through_the_sink_do_not_depend_on_the_split_interpreter() -> None:
    # four samples of whole 16-row tiles; K, N, r non-multiples of every tile
    _check(Target("cpu", torch.float32), (21, 19, 13), 3, (16, 32, 16, 16), LAYOUTS[:3])


@interp
def test_sink_partials_of_one_sample_are_its_autograd_gradient_and_keys_must_match() -> None:
    """A sink with one key receives exactly the sample's own gradient (FP32); a key count that does not match
    the GEMM's samples is refused at the forward."""
    t = Target("cpu", torch.float32)
    net = _Net((53, 45), 5, t)
    x = randn(21, 53, gen=generator(33))
    gy = randn(21, 45, gen=generator(34))
    with collect_sample_grads() as sink, sample_keys(["only"]):
        y = net(x, (21,))
    (y * gy).sum().backward()
    for name, p in net.params.items():
        assert_bytes_equal(sink.fold(p), p.grad, f"single-key sink partial vs autograd {name}")
    with collect_sample_grads(), sample_keys(["a", "b", "c"]), pytest.raises(ValueError, match="3 samples"):
        net(x, (10, 11))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_lora_grads_through_the_sink_do_not_depend_on_the_split(dtype: torch.dtype) -> None:
    target = Target("cuda", dtype)
    skip_unless_compiled(target)
    # odd sample lengths (non-multiples of every BLOCK_M); the attn_out+lora layer of test_triton_gemm.py
    # (3072 → 3072, bias, rank 16), so a whole `-m gpu` run reuses most of its compiled kernels
    _check(target, (3072, 3072), 16, (7, 1, 33, 100, 16, 129, 2, 57), LAYOUTS, epilogue="none")


@interp
@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_a_sink_without_autograd_sums_gets_the_same_partials_and_no_grad(backend: str, monkeypatch) -> None:
    """``SampleGradSink(autograd_sums=False)``: the strict GEMM backward (Triton under the interpreter, and the CPU
    backend) deposits the same per-sample partials, so the same fold bytes, returns no summed LoRA gradient
    (``.grad`` stays None) and, on Triton, launches no summed weight-gradient product; dX still flows (2 layers)."""
    from mmdit_strict.kernels.cpu import gemm as C
    from mmdit_strict.kernels.triton.gemm import launch as L

    gemm = G.gemm if backend == "triton" else C.gemm
    t = Target("cpu", torch.float32)
    net = _Net((21, 19, 13), 3, t)
    lens = (16, 32)  # whole 16-row tiles: the interpreter's forward is row-invariant by whole tiles only
    xs, gys = _data(lens, 21, 13, t)
    keys = sorted(xs)
    summed = []
    real_dw = L.gemm_dw
    monkeypatch.setattr(L, "gemm_dw", lambda *a, **k: summed.append(1) or real_dw(*a, **k))

    def run(sums: bool) -> dict[str, torch.Tensor]:
        sink = SampleGradSink(keys, autograd_sums=sums)
        with collect_sample_grads(sink), sample_keys(keys):
            x = torch.cat([xs[k] for k in keys])
            for w, b, a, bl, scale, pro, epi in net.layers:
                x = gemm(x, w, b, seqlens=tuple(lens[s] for s, _ in keys), prologue=pro, epilogue=epi, lora=(a, bl, scale))
        (x * torch.cat([gys[k] for k in keys])).sum().backward()
        assert all((p.grad is not None) == sums for p in net.params.values()), sums
        sink.done(keys)
        for p in net.params.values():
            p.grad = None
        return {name: sink.fold(p) for name, p in net.params.items()}

    with_sums = run(True)
    launched = len(summed)
    without = run(False)
    for name, f in with_sums.items():
        assert f is not None and float(f.abs().max()) > 0
        assert_bytes_equal(without[name], f, f"{backend} LoRA {name}: fold without autograd sums vs with")
    if backend == "triton":
        assert launched == 4 and len(summed) == launched  # A and B of both layers, summed only when asked


@interp
def test_partials_go_into_the_buffers_a_deposit_log_gives() -> None:
    """The Triton GEMM backward writes each sample's partial into the buffers its sink gives (a captured step's
    shared arena, ``model/train_graphs.py``): the same bytes as fresh ones, one buffer per (parameter, position,
    occurrence) — a layer applied twice gets two — and a second log on the same arena gets the same buffers."""
    from mmdit_strict.kernels.execution import bind, current
    from mmdit_strict.kernels.deposit_log import DepositLog
    from mmdit_strict.model.train_graphs import PartialArena

    t = Target("cpu", torch.float32)
    net = _Net((16, 16), 3, t)
    w, b, a, bl, scale, pro, epi = net.layers[0]
    x0 = randn(48, 16, gen=generator(35))
    gy = randn(48, 16, gen=generator(36))

    def backward(log: DepositLog) -> None:
        with bind(current().replace(grad_sink=log, sample_keys=(0, 1))):
            y = x0
            for _ in range(2):  # the same LoRA layer twice: two partials per (parameter, sample)
                y = G.gemm(y, w, b, seqlens=(16, 32), prologue=pro, epilogue=epi, lora=(a, bl, scale))
        (y * gy).sum().backward()
        for p in net.params.values():
            p.grad = None

    fresh = DepositLog()
    backward(fresh)
    arena = PartialArena()
    arena.reserve(fresh.entries)
    assert len(arena) == 2 * 2 * 2  # A and B × 2 positions × 2 occurrences
    logs = [DepositLog(buffers=arena.buffer) for _ in range(2)]
    for log in logs:
        backward(log)
        assert len(log.entries) == len(fresh.entries) == 4
        for (pa, pos_a, got), (pb, pos_b, want) in zip(log.entries, fresh.entries, strict=True):
            assert pa is pb and pos_a == pos_b
            for g_, w_ in zip(got, want, strict=True):
                assert_bytes_equal(g_, w_, "partial written into the arena vs a fresh one")
    ptrs = [[t_.data_ptr() for _, _, parts in log.entries for t_ in parts] for log in logs]
    assert ptrs[0] == ptrs[1] and len(set(ptrs[0])) == 8
    assert not set(ptrs[0]) & {t_.data_ptr() for _, _, parts in fresh.entries for t_ in parts}
    from mmdit_strict.kernels.triton.gemm import launch as L

    with pytest.raises(ValueError, match="out must be 2 contiguous FP32"):
        L.gemm_dw_samples(gy, x0, (16, 32), out=[torch.empty(16, 16)])
    with pytest.raises(ValueError, match="out must be 2 contiguous FP32"):
        L.gemm_db_samples(gy, (16, 32), out=[torch.empty(16), torch.empty(16, dtype=torch.float64)])

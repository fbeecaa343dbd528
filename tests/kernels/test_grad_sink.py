"""The grad sink's two folds: streamed (keys declared up front, bounded buffer) == stored, in bytes.

The partials here are random FP32 tensors with widely spread magnitudes, so any change in the order
or grouping of the additions shows in the bytes (checked below: a different order gives different
bytes for these inputs).
"""

from __future__ import annotations

import random

import pytest
import torch

from mmdit_strict.kernels.grad_sink import (
    SampleGradSink,
    execution_order,
    pending_bound,
)
from tests.harness import assert_bytes_equal
from tests.kernels.test_fold_tree import tree_reference


def _keys(pairs: int, branches: int = 2) -> list[tuple[tuple[int, int], int]]:
    return [((100 + p // 3, p % 3), br) for p in range(pairs) for br in range(branches)]


def _partials(keys, shapes, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, shape in enumerate(shapes):
        for k in keys:
            mag = torch.exp2(torch.randint(-12, 12, shape, generator=g).float())
            out[i, k] = torch.randn(shape, generator=g) * mag
    return out


def _batches(keys, per_batch: int, seed: int, branches: int = 2):
    """Micro-batches of shuffled pairs; each batch holds both branches of its pairs (as a CFG forward does)."""
    pairs = sorted({k[0] for k in keys})
    random.Random(seed).shuffle(pairs)
    return [[(p, br) for br in range(branches) for p in pairs[i:i + per_batch]] for i in range(0, len(pairs), per_batch)]


def _run(sink: SampleGradSink, params, parts, batches, order, branch_first: int = 1, transfer: bool = False):
    """Deposit like a backward does: per batch, per parameter (reverse layer order), one call per CFG branch
    (``transfer``: fresh copies handed over, as the Triton backward does)."""
    for j in order:
        b = batches[j]
        for i in reversed(range(len(params))):
            for br in (branch_first, 1 - branch_first):
                ks = [k for k in b if k[1] == br]
                if transfer:
                    sink.add(params[i], ks, [parts[i, k].clone() for k in ks], transfer=True)
                else:
                    sink.add(params[i], ks, [parts[i, k] for k in ks])
        sink.done(b)
    return [sink.fold(p) for p in params]


SHAPES = [(4, 7), (9, 4), (5,)]


@pytest.mark.parametrize("per_batch, seed", [(1, 0), (2, 1), (4, 2), (3, 3)])
def test_streamed_fold_equals_stored_fold_bytes(per_batch: int, seed: int) -> None:
    keys = _keys(12)
    params = [torch.zeros(s) for s in SHAPES]
    parts = _partials(keys, SHAPES, seed)
    batches = _batches(keys, per_batch, seed)
    stored = _run(SampleGradSink(), params, parts, batches, range(len(batches)))
    for order in (list(range(len(batches))), execution_order(batches), list(reversed(range(len(batches))))):
        for transfer in (False, True):
            streamed = _run(SampleGradSink(keys), params, parts, batches, order, transfer=transfer)
            for i, (a, b) in enumerate(zip(streamed, stored)):
                assert_bytes_equal(a, b, f"param {i}, micro-batches of {per_batch} pairs, order {order}, transfer {transfer}")
    for i, (a, b) in enumerate(zip(_run(SampleGradSink(), params, parts, batches, range(len(batches)), transfer=True), stored)):
        assert_bytes_equal(a, b, f"param {i}, stored fold of handed-over partials")
    # the fold is the pairwise tree over the sorted keys, and the grouping matters for these inputs
    for i in range(len(SHAPES)):
        leaves = [parts[i, k] for k in sorted(keys)]
        assert_bytes_equal(stored[i], tree_reference(leaves), f"param {i} vs the tree over the sorted keys")
        acc = None
        for t in leaves:
            acc = t.clone() if acc is None else acc + t
        assert not torch.equal(acc, stored[i]), "test inputs too tame: the left fold gives the tree's bytes"


@pytest.mark.parametrize("per_batch, seed", [(1, 4), (2, 5), (4, 6)])
def test_streamed_buffer_stays_within_the_bound(per_batch: int, seed: int) -> None:
    keys = _keys(16)
    params = [torch.zeros(s) for s in SHAPES]
    parts = _partials(keys, SHAPES, seed)
    batches = _batches(keys, per_batch, seed)
    for order in (list(range(len(batches))), execution_order(batches)):
        sink = SampleGradSink(keys)
        _run(sink, params, parts, batches, order)
        bound = pending_bound([batches[j] for j in order])
        st = sink.stats
        assert st.deposits == len(keys) * len(params)
        assert st.peak_pending_per_param <= bound, (order, st, bound)
        assert st.peak_pending <= bound * len(params)
    # execution by smallest key buffers no more than the order as cut
    assert pending_bound([batches[j] for j in execution_order(batches)]) <= pending_bound(batches)
    # micro-batches of consecutive sorted keys, run in order: at most one micro-batch minus its first key
    ordered = [sorted(keys)[i:i + 2 * per_batch] for i in range(0, len(keys), 2 * per_batch)]
    assert pending_bound(ordered) == 2 * per_batch - 1
    sink = SampleGradSink(keys)
    _run(sink, params, parts, ordered, range(len(ordered)))
    assert sink.stats.peak_pending_per_param <= 2 * per_batch - 1
    # the stored fold keeps everything
    stored = SampleGradSink()
    _run(stored, params, parts, batches, range(len(batches)))
    assert stored.stats.peak_pending == len(keys) * len(params)


def test_in_order_arrival_buffers_nothing_and_keeps_no_caller_tensor() -> None:
    keys = _keys(5, branches=1)
    p = torch.zeros(3, 3)
    parts = _partials(keys, [(3, 3)])
    sink = SampleGradSink(keys)
    for k in sorted(keys):
        t = parts[0, k].clone()
        sink.add(p, [k], [t])
        t.fill_(float("nan"))  # the caller reuses its buffer
        sink.done([k])
    assert sink.stats.peak_pending == 0
    want = SampleGradSink()
    for k in keys:
        want.add(p, [k], [parts[0, k]])
    assert_bytes_equal(sink.fold(p), want.fold(p), "in-order streamed fold")
    assert sink.fold(p) is sink.fold(p)


def test_a_key_without_a_deposit_for_a_parameter_is_skipped_once_done() -> None:
    keys = _keys(4, branches=1)
    p, q = torch.zeros(2), torch.zeros(2)
    parts = _partials(keys, [(2,)])
    skip = min(keys)
    sink = SampleGradSink(keys)
    stored = SampleGradSink()
    for k in sorted(keys):
        sink.add(p, [k], [parts[0, k]])
        stored.add(p, [k], [parts[0, k]])
        if k != skip:  # q never sees the smallest key
            sink.add(q, [k], [parts[0, k]])
            stored.add(q, [k], [parts[0, k]])
        sink.done([k])
    assert sink.stats.peak_pending_per_param == 0, "done() must let q's fold move past the key it never got"
    for t in (p, q):
        assert_bytes_equal(sink.fold(t), stored.fold(t), "skip-key fold")
    assert sink.fold(torch.zeros(2)) is None


def test_streamed_sink_refuses_what_would_change_bytes() -> None:
    keys = _keys(3, branches=1)
    p = torch.zeros(2)
    one = torch.ones(2)
    with pytest.raises(ValueError, match="distinct"):
        SampleGradSink(keys + keys[:1])
    sink = SampleGradSink(keys)
    with pytest.raises(ValueError, match="not declared"):
        sink.add(p, [((999, 0), 0)], [one])
    with pytest.raises(ValueError, match="2 sample keys for 1"):
        sink.add(p, keys[:2], [one])
    sink.add(p, [keys[1]], [one])
    with pytest.raises(ValueError, match="second gradient partial"):
        sink.add(p, [keys[1]], [one])
    sink.done([keys[0]])
    with pytest.raises(ValueError, match="done"):
        sink.add(p, [keys[0]], [one])
    with pytest.raises(ValueError, match="not declared"):
        sink.done([((999, 0), 0)])
    sink.fold(p)
    with pytest.raises(ValueError, match="already taken"):
        sink.add(p, [keys[2]], [one])


def test_stored_sink_sums_a_key_deposited_twice() -> None:
    """A layer applied twice per sample: the stored fold adds the key's deposits first (arrival order)."""
    p = torch.zeros(2)
    a, b, c = torch.tensor([1.0, 2.0**-30]), torch.tensor([2.0**24, 1.0]), torch.tensor([-(2.0**24), 3.0])
    sink = SampleGradSink()
    sink.add(p, ["k1"], [a])
    sink.add(p, ["k0"], [b])
    sink.add(p, ["k0"], [c])
    assert_bytes_equal(sink.fold(p), (b + c) + a, "stored fold with a repeated key")

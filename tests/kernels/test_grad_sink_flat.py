"""Flat deposits into the grad sink (``SampleGradSink.add_flat``): many tensors folded as one group give each
tensor the bytes of its own fold, mixed with per-tensor deposits, parked, handed out as a key range's nodes;
and a deposit log hands a captured backward's flat buffers over in one call."""

from __future__ import annotations

import time

import pytest
import torch

from mmdit_strict.kernels.fold_park import HostPark
from mmdit_strict.kernels.deposit_log import DepositLog, FlatBuffers
from mmdit_strict.kernels.grad_sink import SampleGradSink
from tests.harness import assert_bytes_equal
from tests.kernels.test_grad_sink import _batches, _keys, _partials, _run

SHAPES = [(3, 5), (7,), (2, 2, 3), (1,), (4, 6)]


def _layout(shapes, gap: int = 3) -> tuple[list[int], int]:
    """Offsets with ``gap`` unused elements before each tensor (what no tensor owns must not leak into any fold)."""
    offsets, at = [], 0
    for s in shapes:
        at += gap
        offsets.append(at)
        at += int(torch.Size(s).numel())
    return offsets, at + gap


def _case(keys, seed: int):
    """Tensors of :data:`SHAPES`, their random partials for ``keys``, a flat layout with junk between the spans and
    every tensor's index: ``(params, parts, offsets, size, idx)``."""
    params = [torch.empty(s) for s in SHAPES]
    offsets, size = _layout(SHAPES)
    return params, _partials(keys, SHAPES, seed=seed), offsets, size, list(range(len(params)))


def _pack(parts, i_params, k, offsets, size) -> torch.Tensor:
    flat = torch.full((size,), float("nan"), device=parts[i_params[0], k].device)
    flat[::2] = 3.0e38  # junk between the spans: NaN and values that overflow when added
    for i, off in zip(i_params, offsets):
        v = parts[i, k]
        flat[off:off + v.numel()] = v.reshape(-1)
    return flat


def _run_flat(sink, params, parts, batches, order, offsets, size, branch_first: int = 1, per_tensor_at=None):
    """As ``_run``, but each (batch, branch) hands every tensor's partials over in one ``add_flat``; at batch
    ``per_tensor_at`` the deposits go tensor by tensor instead (a step that ran uncaptured)."""
    idx = list(range(len(params)))
    for n, j in enumerate(order):
        b = batches[j]
        for br in (branch_first, 1 - branch_first):
            ks = [k for k in b if k[1] == br]
            if n == per_tensor_at:
                for i in reversed(idx):
                    sink.add(params[i], ks, [parts[i, k] for k in ks])
            else:
                sink.add_flat(params, offsets, ks, [_pack(parts, idx, k, offsets, size) for k in ks])
        sink.done(b)
    return [sink.fold(p) for p in params]


@pytest.mark.parametrize("per_batch,seed,per_tensor_at", [(1, 0, None), (2, 1, None), (3, 2, None), (2, 3, 2),
                                                          (2, 4, 0)])
@pytest.mark.parametrize("park", [False, True])
def test_flat_deposits_fold_each_tensor_to_its_own_bytes(per_batch: int, seed: int, per_tensor_at, park: bool) -> None:
    keys = _keys(11)
    params = [torch.empty(s) for s in SHAPES]
    parts = _partials(keys, SHAPES, seed=seed)
    batches = _batches(keys, per_batch, seed)
    order = list(range(len(batches)))[::-1] if seed % 2 else list(range(len(batches)))  # out of order: buffering
    offsets, size = _layout(SHAPES)
    want = _run(SampleGradSink(keys), params, parts, batches, order)
    stored = _run(SampleGradSink(), params, parts, batches, order)
    flat = SampleGradSink(keys, park=HostPark(lookahead=2) if park else None)
    t0 = time.perf_counter()
    got = _run_flat(flat, params, parts, batches, order, offsets, size, per_tensor_at=per_tensor_at)
    wall = time.perf_counter() - t0
    assert 0 < flat.stats.host_seconds <= wall  # the calls into itself (a split group's add) are not counted twice
    for i in range(len(params)):
        assert_bytes_equal(got[i], want[i], f"tensor {i} (flat vs per tensor)")
        assert_bytes_equal(got[i], stored[i], f"tensor {i} (flat vs stored)")
        assert got[i].shape == params[i].shape
    # a group forms from the first flat deposits, unless tensors were folded alone before them
    assert flat.stats.group_tensors == (0 if per_tensor_at == 0 else len(params))
    assert flat.stats.deposits == len(keys) * len(params)


def test_the_group_counts_what_it_buffers_per_tensor() -> None:
    """Buffered partials and open nodes count per tensor, as the per-tensor fold counts them; the group's
    tensors wait together (the per-tensor run here takes each tensor's two branches before the next tensor's)."""
    keys = _keys(8)
    params, parts, offsets, size, idx = _case(keys, 5)
    batches = _batches(keys, 2, 5)
    order = list(range(len(batches)))[::-1]
    one = SampleGradSink(keys)
    _run(one, params, parts, batches, order)
    many = SampleGradSink(keys)
    _run_flat(many, params, parts, batches, order, offsets, size)
    a, b = one.stats, many.stats
    assert (b.peak_pending_per_param, b.peak_nodes_per_param) == (a.peak_pending_per_param, a.peak_nodes_per_param)
    assert b.peak_pending == len(params) * b.peak_pending_per_param > a.peak_pending > 0 and a.group_tensors == 0


def test_flat_buffers_are_read_during_the_call_only() -> None:
    keys = _keys(3)
    params, parts, offsets, size, idx = _case(keys, 6)
    sink = SampleGradSink(keys)
    for k in sorted(keys, reverse=True):  # reverse order: everything but the last waits in the buffer
        flat = _pack(parts, idx, k, offsets, size)
        sink.add_flat(params, offsets, [k], [flat])
        flat.fill_(7.0)  # a captured backward rewrites its buffers at the next replay
    ref = SampleGradSink(keys)
    for k in keys:
        for i, p in enumerate(params):
            ref.add(p, [k], [parts[i, k]])
    for i, p in enumerate(params):
        assert_bytes_equal(sink.fold(p), ref.fold(p), f"tensor {i}")


@pytest.mark.parametrize("first", [0, 6])
def test_a_groups_range_nodes_are_each_tensors_own(first: int) -> None:
    keys = _keys(5)
    params, parts, offsets, size, idx = _case(keys, 7)
    per, flat = SampleGradSink(keys, first_index=first), SampleGradSink(keys, first_index=first)
    for k in keys:
        for i, p in enumerate(params):
            per.add(p, [k], [parts[i, k]])
        flat.add_flat(params, offsets, [k], [_pack(parts, idx, k, offsets, size)])
    for i, p in enumerate(params):
        a, b = per.nodes(p), flat.nodes(p)
        assert [(n.level, n.start) for n in a] == [(n.level, n.start) for n in b]
        for x, y in zip(a, b):
            assert_bytes_equal(y.value, x.value, f"tensor {i} node ({x.level}, {x.start})")
    with pytest.raises(ValueError, match="already taken"):
        flat.nodes(params[0])
    with pytest.raises(ValueError, match="already taken"):
        flat.add_flat(params, offsets, [keys[0]], [_pack(parts, idx, keys[0], offsets, size)])


def test_add_flat_refuses_what_add_refuses_and_bad_buffers() -> None:
    keys = _keys(2)
    params, parts, offsets, size, idx = _case(keys, 8)
    sink = SampleGradSink(keys)
    flat = _pack(parts, idx, keys[1], offsets, size)
    sink.add_flat(params, offsets, [keys[1]], [flat])
    with pytest.raises(ValueError, match="second gradient partial"):
        sink.add_flat(params, offsets, [keys[1]], [flat])
    with pytest.raises(ValueError, match="not declared"):
        sink.add_flat(params, offsets, [("nope", 0)], [flat])
    with pytest.raises(ValueError, match="1-D FP32"):
        sink.add_flat(params, offsets, [keys[0]], [flat.double()])
    with pytest.raises(ValueError, match="overlap"):
        SampleGradSink(keys).add_flat(params, [0] * len(params), [keys[0]], [flat])
    with pytest.raises(ValueError, match="overlap or leave"):
        SampleGradSink(keys).add_flat(params, [o + size for o in offsets], [keys[0]], [flat])
    with pytest.raises(ValueError, match="sample keys for"):
        sink.add_flat(params, offsets, keys, [flat])
    sink.done([keys[0]])
    with pytest.raises(ValueError, match="told it is done"):
        sink.add_flat(params, offsets, [keys[0]], [flat])


def test_a_stored_sink_takes_flat_deposits_tensor_by_tensor() -> None:
    keys = _keys(3)
    params, parts, offsets, size, idx = _case(keys, 9)
    sink, ref = SampleGradSink(), SampleGradSink()
    for k in keys:
        flat = _pack(parts, idx, k, offsets, size)
        sink.add_flat(params, offsets, [k], [flat])
        flat.fill_(0.0)
        for i, p in enumerate(params):
            ref.add(p, [k], [parts[i, k]])
    for i, p in enumerate(params):
        assert_bytes_equal(sink.fold(p), ref.fold(p), f"tensor {i}")
    assert sink.stats.group_tensors == 0


def _log_with_flat(params, batch: int):
    offsets, size = _layout([p.shape for p in params])
    flats = tuple(torch.zeros(size) for _ in range(batch))
    fb = FlatBuffers(tuple(params), tuple(offsets), flats)
    log = DepositLog()
    log.flat = fb
    return log, fb


def test_deposit_log_hands_its_flat_buffers_over_in_one_call() -> None:
    """Tensors with one partial per position in their views go over as one group; a tensor with no deposit stays
    out of it (its fold is None) and a deposit outside the buffers goes tensor by tensor; the bytes are each
    tensor's own fold's."""
    params = [torch.empty(s) for s in SHAPES]
    other = torch.empty(2, 3)
    log, fb = _log_with_flat(params, 2)
    g = torch.Generator().manual_seed(10)
    deposited = [0, 1, 3, 4]  # tensor 2 has no path to the loss here
    for j in deposited:
        views = [fb.view(j, 0), fb.view(j, 1)]
        for v in views:
            v.copy_(torch.randn(v.shape, generator=g))
        log.add(params[j], (0, 1), views)
    extra = [torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)]
    log.add(other, (0, 1), extra)
    keys = [("k", 1), ("k", 0)]
    sink = SampleGradSink(keys)
    log.replay(sink, keys)
    sink.done(keys)
    assert sink.stats.group_tensors == len(deposited)
    ref = SampleGradSink(keys)
    for param, positions, partials in log.entries:
        ref.add(param, [keys[i] for i in positions], partials)
    ref.done(keys)
    for j, p in enumerate(params):
        if j in deposited:
            assert_bytes_equal(sink.fold(p), ref.fold(p), f"tensor {j}")
        else:
            assert sink.fold(p) is None
    assert_bytes_equal(sink.fold(other), ref.fold(other), "the tensor outside the flat buffers")


def test_deposit_log_without_a_whole_group_deposits_tensor_by_tensor() -> None:
    """A tensor with a partial at one position only, or a second deposit elsewhere, keeps the whole log on the
    per-tensor path (same bytes)."""
    params = [torch.empty(s) for s in SHAPES]
    for case in ("one position", "twice"):
        log, fb = _log_with_flat(params, 2)
        for j in range(len(params)):
            log.add(params[j], (0,) if case == "one position" and j == 1 else (0, 1),
                    [fb.view(j, 0)] if case == "one position" and j == 1 else [fb.view(j, 0), fb.view(j, 1)])
        if case == "twice":
            log.add(params[3], (0,), [torch.ones(params[3].shape)])
        sink = SampleGradSink()  # stored: a second deposit of a key is summed
        keys = [("k", 0), ("k", 1)]
        log.replay(SampleGradSink(keys) if case == "one position" else sink, keys)
        assert log._flat_plan() is None, case


@pytest.mark.parametrize("split_at,back_started", [(6, False), (7, True)])
def test_a_group_split_while_a_node_is_parked_keeps_the_bytes(monkeypatch: pytest.MonkeyPatch, split_at: int,
                                                             back_started: bool) -> None:
    """Batches of one pair in key order, lookahead 2: leaves 0-7 wait parked for 8-15. A step tensor by tensor at
    batch 6 splits the group while that node is parked; at batch 7 also while leaves 8-11 come back."""
    keys = sorted(_keys(11))
    params, parts, offsets, size, idx = _case(keys, 11)
    batches = [keys[i:i + 2] for i in range(0, len(keys), 2)]
    order = list(range(len(batches)))
    seen = []
    split = HostPark.split

    def spy(self, node, spans):
        seen.append((node.level, node.start, node.back is not None))
        return split(self, node, spans)

    monkeypatch.setattr(HostPark, "split", spy)
    park = HostPark(lookahead=2)
    got = _run_flat(SampleGradSink(keys, park=park), params, parts, batches, order, offsets, size, per_tensor_at=split_at)
    assert seen and seen[0] == (3, 0, False) and any(started for *_, started in seen) == back_started
    want = _run(SampleGradSink(keys), params, parts, batches, order)
    for i in range(len(params)):
        assert_bytes_equal(got[i], want[i], f"tensor {i}")
    assert park.stats.parks > 1 and park.stats.fetches > len(params)  # the split node came back tensor by tensor


@pytest.mark.gpu
@pytest.mark.parametrize("split_at", [None, 7])
def test_gpu_flat_deposits_parked_fold_each_tensor_to_its_own_bytes(split_at) -> None:
    """On the GPU the park's copies run on a side stream: a group parked (and split while a node comes back)
    still gives every tensor its own fold's bytes."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    keys = sorted(_keys(11))
    shapes = [(300, 70), (7,), (64, 3, 5), (1,), (129, 33)]
    params = [torch.empty(s, device="cuda") for s in shapes]
    parts = {ik: v.cuda() for ik, v in _partials(keys, shapes, seed=12).items()}
    batches = [keys[i:i + 2] for i in range(0, len(keys), 2)]
    order = list(range(len(batches)))
    offsets, size = _layout(shapes, gap=64)
    park = HostPark(lookahead=2)
    got = _run_flat(SampleGradSink(keys, park=park), params, parts, batches, order, offsets, size, per_tensor_at=split_at)
    want = _run(SampleGradSink(keys), params, parts, batches, order)
    torch.cuda.synchronize()
    for i in range(len(params)):
        assert_bytes_equal(got[i], want[i], f"tensor {i}")
    assert park.stats.parks > 0 and park.stats.peak_host_bytes > 0


def _node_flat(parts, idx, keys_sorted, offsets, size) -> torch.Tensor:
    """What a captured step folding its own batch hands over: per tensor, the pairwise fold of the keys' partials in
    sorted-key order, in one flat buffer (junk between the spans)."""
    from mmdit_strict.kernels.fold_tree import fold

    flat = _pack(parts, idx, keys_sorted[0], offsets, size)
    for i, off in zip(idx, offsets):
        node = fold([parts[i, k] for k in keys_sorted])
        flat[off:off + node.numel()] = node.reshape(-1)
    return flat


@pytest.mark.parametrize("how", ["nodes in order", "nodes out of order", "mixed", "split", "parked"])
def test_flat_nodes_of_whole_micro_batches_fold_to_each_tensors_own_bytes(how: str) -> None:
    """Micro-batches of 4 consecutive keys from a multiple of 4 handed over as the fold of their partials (one node)
    give every tensor its per-tensor fold's bytes: in key order, out of order (nodes wait in the buffer), mixed with
    flat per-key deposits, with one micro-batch tensor by tensor (the group splits), parked."""
    keys = sorted(_keys(10))  # 20 keys: micro-batches of 4, and a last one of 4 that ends past a power of two
    params, parts, offsets, size, idx = _case(keys, 13)
    batches = [keys[i:i + 4] for i in range(0, len(keys), 4)]
    order = [1, 0, 3, 4, 2] if how == "nodes out of order" else list(range(len(batches)))
    park = HostPark(lookahead=2) if how == "parked" else None
    sink = SampleGradSink(keys, park=park)
    for n, j in enumerate(order):
        b = batches[j]
        assert sink.node_order(b[::-1]) == (3, 2, 1, 0)
        if how == "mixed" and n % 2:
            sink.add_flat(params, offsets, b, [_pack(parts, idx, k, offsets, size) for k in b])
        elif how == "split" and n == 2:
            for i, p in enumerate(params):
                sink.add(p, b, [parts[i, k] for k in b])
        else:
            flat = _node_flat(parts, idx, b, offsets, size)
            sink.add_flat_node(params, offsets, b[::-1], flat)  # batch order need not be key order
            flat.fill_(5.0)  # read during the call only
        sink.done(b)
    want = _run(SampleGradSink(keys), params, parts, [[k] for k in keys], list(range(len(keys))))
    for i, p in enumerate(params):
        assert_bytes_equal(sink.fold(p), want[i], f"tensor {i} ({how})")
    assert sink.stats.group_tensors == len(params)
    if how == "nodes out of order":
        # micro-batches 3 and 4 waited for 2 as two nodes, not eight partials
        assert sink.stats.peak_pending_per_param == 2
    if park is not None:
        assert park.stats.parks > 0


def test_node_order_says_which_batches_are_one_node() -> None:
    keys = sorted(_keys(8))  # 16 keys
    sink = SampleGradSink(keys)
    assert sink.node_order([keys[5], keys[4]]) == (1, 0)
    assert sink.node_order(keys[8:16]) == tuple(range(8))
    assert sink.node_order(keys[4:8][::-1]) == (3, 2, 1, 0)
    assert sink.node_order([keys[0], keys[2]]) is None  # not next to each other
    assert sink.node_order(keys[2:6]) is None  # not from a multiple of 4
    assert sink.node_order(keys[0:3]) is None and sink.node_order(keys[:1]) is None  # not 2^l >= 2 keys
    assert sink.node_order([keys[0], ("nope", 0)]) is None and SampleGradSink().node_order(keys[:2]) is None
    shifted = SampleGradSink(keys[:8], first_index=2)  # a rank's share from leaf 2: its keys 0-1 sit at leaves 2-3
    assert shifted.node_order(keys[0:2]) == (0, 1) and shifted.node_order(keys[0:4]) is None
    with pytest.raises(ValueError, match="not the leaves of one complete node"):
        sink.add_flat_node([torch.empty(2)], [0], keys[1:3], torch.zeros(2))
    with pytest.raises(ValueError, match="streamed fold only"):
        SampleGradSink().add_flat_node([torch.empty(2)], [0], keys[0:2], torch.zeros(2))


@pytest.mark.parametrize("how", ["carried", "flushed by a deposit", "flushed at the end", "parked"])
def test_a_carried_node_takes_its_sibling_in_place_with_the_folds_bytes(how: str) -> None:
    """``carry``: a step whose keys are a left child node leaves it in its flat buffer; the next step, its sibling, adds
    its node into that buffer and hands both keys' sum, the parent node. Every tensor gets its per-tensor fold's bytes,
    and the keys declared done while carried are not taken as empty. A carried node whose sibling does not come that
    way is flushed (copied into the fold) by the next other deposit, or by ``fold``."""
    keys = sorted(_keys(10))  # 20 keys: micro-batches of 2 keys (one pair's two CFG branches), 10 of them
    params, parts, offsets, size, idx = _case(keys, 21)
    batches = [keys[i:i + 2] for i in range(0, len(keys), 2)]
    park = HostPark(lookahead=0) if how == "parked" else None
    sink = SampleGradSink(keys, park=park)
    arena = torch.full((size,), float("nan"))  # the shared partial buffer every captured step writes
    last = len(batches) - 2 if how == "flushed at the end" else len(batches) - 1  # that case: the last pair never runs
    sums = 0
    for n, b in enumerate(batches[:last + 1]):
        node = _node_flat(parts, idx, b, offsets, size)
        left = sink.carried_left_of(b, arena)
        if how == "flushed by a deposit" and n == 3:  # this step ran uncaptured: its partials come tensor by tensor
            assert left is not None
            for i, p in enumerate(params):
                sink.add(p, b, [parts[i, k] for k in b])
        elif left is not None:  # the captured step adds its node into the carried one: left + right
            assert list(left) == batches[n - 1]
            arena.copy_(arena + node)
            sums += 1
            sink.add_flat_node(params, offsets, [*left, *b], arena)
        else:
            arena.copy_(node)
            if sink.can_carry(b):
                sink.carry(params, offsets, b, arena)
            else:
                sink.add_flat_node(params, offsets, b, arena)
        sink.done(b)
    covered = keys[:2 * (last + 1)]
    want = _run(SampleGradSink(keys), params, parts, [[k] for k in covered], list(range(len(covered))))
    for i, p in enumerate(params):
        assert_bytes_equal(sink.fold(p), want[i], f"tensor {i} ({how})")
    # micro-batches 0, 2, 4, 6 and 8 are left children of level-1 nodes whose siblings are among the keys
    assert sink.carried == 5 and not sink.can_carry(batches[0])
    assert sums == {"carried": 5, "flushed by a deposit": 4, "flushed at the end": 4, "parked": 5}[how]
    if park is not None:
        assert park.stats.parks > 0


def test_carry_takes_only_a_left_child_with_its_sibling_in_range() -> None:
    keys = sorted(_keys(3))  # 6 keys
    sink = SampleGradSink(keys)
    params, offsets, flat = [torch.empty(2)], [0], torch.zeros(2)
    assert sink.can_carry(keys[0:2]) and sink.can_carry(keys[4:6][::-1]) is False
    assert not sink.can_carry(keys[2:4])  # a right child
    assert not sink.can_carry(keys[0:4])  # its sibling would be keys 4-7: past the end
    assert not sink.can_carry(keys[1:3]) and not SampleGradSink().can_carry(keys[0:2])
    sink.carry(params, offsets, keys[0:2], flat)
    assert not sink.can_carry(keys[0:2])  # one at a time
    with pytest.raises(ValueError, match="cannot be carried"):
        sink.carry(params, offsets, keys[0:2], flat)
    assert sink.carried_left_of(keys[2:4], flat) == tuple(keys[0:2])
    assert sink.carried_left_of(keys[2:4], torch.zeros(2)) is None  # not where the node waits
    assert sink.carried_left_of(keys[4:6], flat) is None  # not its sibling
    shifted = SampleGradSink(keys[:4], first_index=2)  # from leaf 2: its keys 0-1 are a right child
    assert not shifted.can_carry(keys[0:2])
    assert not shifted.can_carry(keys[2:4])  # a left child at leaves 4-5, its sibling at 6-7: past the range's end


@pytest.mark.parametrize("uncaptured_at", [None, 5])
def test_a_folding_log_carries_left_nodes_and_adds_their_siblings_into_them(uncaptured_at) -> None:
    """What a captured step with ``accumulate`` does at each replay, its graph stood in for by the log's own folded
    deposits: a left child's node stays in the flat buffer (carried), the sibling's step sets the flag and adds into it,
    and the sink gets the parent; every tensor ends with its per-tensor fold's bytes. At ``uncaptured_at`` a step runs
    uncaptured (per-tensor deposits) and the carried node before it is placed first."""
    keys = sorted(_keys(8))  # 16 keys: 8 steps of one pair's two branches
    params, parts, offsets, size, idx = _case(keys, 31)
    fb = FlatBuffers(tuple(params), tuple(offsets), (torch.full((size,), float("nan")),))
    log = DepositLog(fold=(0, 1), buffers=lambda p, pos, n: fb.view(next(j for j, q in enumerate(params) if q is p), 0)
                     if pos == 0 and n == 0 else None)
    log.flat = fb
    log.accumulate = torch.zeros((), dtype=torch.bool)
    sink = SampleGradSink(keys)
    flags = []
    for m in range(8):
        b = keys[2 * m:2 * m + 2]
        if m == uncaptured_at:
            for i, p in enumerate(params):
                sink.add(p, b, [parts[i, k] for k in b])
            flags.append(None)
        else:
            log.before_replay(sink, b)
            flags.append(bool(log.accumulate))
            log.clear()  # the stand-in for the replay: the step's deposits, folded into the flat buffer
            for i, p in enumerate(params):
                log.add(p, (0, 1), [parts[i, k].clone() for k in b])
            log.replay(sink, b)
        sink.done(b)
    want = _run(SampleGradSink(keys), params, parts, [[k] for k in keys], list(range(len(keys))))
    for i, p in enumerate(params):
        assert_bytes_equal(sink.fold(p), want[i], f"tensor {i}")
    if uncaptured_at is None:
        assert flags == [False, True] * 4 and sink.carried == 4
    else:  # step 4 was carried, step 5 ran uncaptured: step 4's node was placed as it was
        assert flags == [False, True, False, True, False, None, False, True] and sink.carried == 4

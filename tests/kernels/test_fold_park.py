"""Parking the streamed fold's waiting nodes in host memory (``kernels/fold_park.py``): the fold's bytes do not
change, every node but the one being written waits parked, and copies back are issued ahead of the join."""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.kernels.fold_park import HostBuffers, HostPark, ParkedNode
from mmdit_strict.kernels.fold_tree import Node, PairwiseFold
from mmdit_strict.kernels.grad_sink import SampleGradSink
from tests.harness import assert_bytes_equal
from tests.kernels.test_fold_tree import _leaves, tree_reference
from tests.kernels.test_grad_sink import SHAPES, _batches, _keys, _partials, _run


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 33, 64])
def test_a_parked_fold_gives_the_trees_bytes(n: int) -> None:
    leaves = _leaves(n, seed=n, empty=(2, 7))
    park = HostPark(lookahead=0)
    f = PairwiseFold(park=park)
    for i, v in enumerate(leaves):
        f.leaf(v, owned=False)
        # with no lookahead only the node being written is on the device; every covered one waits parked
        assert all(isinstance(x, ParkedNode) for x in f.nodes[:-1] if x.value is not None), i
    assert_bytes_equal(f.result(), tree_reference(leaves), f"{n} leaves")
    s = park.stats
    assert s.parks == s.fetches and park._host_bytes == 0  # every parked node came back
    assert (s.parks > 0) == (n >= 3) and s.prefetched == 0  # no lookahead: each copy back issued at its join
    # a parked node joins a sibling the fold owns (the settled copy of a leaf, or a sum) by adding into it from the host;
    # one whose sibling is empty comes back as it is
    assert s.added_from_host <= s.fetches and (s.added_from_host > 0) == (n >= 5)
    # host times: each park's allocation is part of its park time; nothing parked, nothing timed
    assert 0.0 <= s.host_alloc_s <= s.park_s and ((s.park_s > 0) == (s.back_s > 0) == (s.parks > 0))
    assert all(v is None or not torch.equal(v, torch.zeros_like(v)) for v in leaves)  # the callers' leaves untouched


def test_lookahead_issues_every_copy_back_before_the_join() -> None:
    leaves = _leaves(40, seed=3)
    early, late = HostPark(lookahead=64), HostPark(lookahead=0)
    for park in (early, late):
        f = PairwiseFold(park=park)
        for v in leaves:
            f.leaf(v, owned=False)
        assert_bytes_equal(f.result(), tree_reference(leaves), "40 leaves")
    assert late.stats.parks > 0 and late.stats.prefetched == 0
    assert early.stats.parks == 0  # every node would join within the lookahead: none is sent away only to come back
    mid = HostPark(lookahead=4)
    f = PairwiseFold(park=mid)
    for v in leaves[:32]:  # a power of two: every node joins while leaves arrive, none waits for result()
        f.leaf(v, owned=False)
    assert_bytes_equal(f.result(), tree_reference(leaves[:32]), "32 leaves, lookahead 4")
    assert 0 < mid.stats.parks < late.stats.parks and 0 < mid.stats.prefetched < mid.stats.fetches
    # the last joins of 64 leaves: [0, 32), [32, 48) and [48, 56) wait parked; one at a time comes back early
    park = HostPark(lookahead=4)
    f = PairwiseFold(park=park)
    more = _leaves(64, seed=5)
    for v in more[:63]:
        f.leaf(v, owned=False)
        assert sum(park.returning(n) for n in f.nodes) <= 1
    assert [(n.level, park.parked(n), park.returning(n)) for n in f.nodes[:3]] == [(5, True, False), (4, True, False),
                                                                                 (3, False, True)]
    f.leaf(more[63], owned=False)
    assert_bytes_equal(f.result(), tree_reference(more), "64 leaves")
    # a node (level l, start s) is prefetched once the leaves reach s + 2^(l+1) - lookahead, not before
    park = HostPark(lookahead=2)
    f = PairwiseFold(park=park)
    for v in leaves[:4]:
        f.leaf(v, owned=False)  # [0, 4) complete; [0, 2) was not parked under leaf 2 (it joins at 4 <= 3 + 2)
    assert park.stats.parks == 0
    f.leaf(leaves[4], owned=False)  # covers [0, 4): it joins at leaf 8 > 5 + 2, parked
    assert isinstance(f.nodes[0], ParkedNode) and f.nodes[0].back is None and park.stats.parks == 1
    f.leaf(leaves[5], owned=False)  # next = 6 >= 8 - 2: its copy back starts
    assert f.nodes[0].back is not None and park.stats.prefetched == 1


@pytest.mark.parametrize("per_batch, seed", [(1, 0), (2, 1), (3, 2)])
def test_a_parking_sink_folds_the_same_bytes(per_batch: int, seed: int) -> None:
    keys = _keys(12)
    params = [torch.zeros(s) for s in SHAPES]
    parts = _partials(keys, SHAPES, seed)
    batches = _batches(keys, per_batch, seed)
    plain = _run(SampleGradSink(keys), params, parts, batches, range(len(batches)))
    park = HostPark(lookahead=per_batch * 2)
    parked = _run(SampleGradSink(keys, park=park), params, parts, batches, range(len(batches)))
    for i, (a, b) in enumerate(zip(parked, plain)):
        assert_bytes_equal(a, b, f"param {i}")
    assert park.stats.parks > 0 and park._host_bytes == 0
    # a key range (as a rank folds it): its nodes come back from the host for the exchange
    ranged = SampleGradSink(sorted(keys)[:7], first_index=5, park=HostPark(lookahead=0))
    other = SampleGradSink(sorted(keys)[:7], first_index=5)
    for s in (ranged, other):
        for k in sorted(keys)[:7]:
            s.add(params[0], [k], [parts[0, k]])
    got, want = ranged.nodes(params[0]), other.nodes(params[0])
    assert [(n.level, n.start) for n in got] == [(n.level, n.start) for n in want]
    assert not any(isinstance(n, ParkedNode) for n in got)
    for a, b in zip(got, want):
        assert_bytes_equal(a.value, b.value, f"node {a.level}, {a.start}")


def test_park_needs_the_streamed_fold_and_a_sane_lookahead() -> None:
    with pytest.raises(ValueError, match="streamed fold"):
        SampleGradSink(park=HostPark())
    with pytest.raises(ValueError, match="lookahead"):
        HostPark(lookahead=-1)
    with pytest.raises(ValueError, match="lookahead"):
        HostPark.for_micro_batches([["a", "b"]], lookahead=-2)


def test_host_buffers_kept_across_updates_are_reused_with_the_same_bytes() -> None:
    """Two updates' folds parking through one pool of host buffers: the second makes none, and each result is the
    tree's bytes (a reused buffer is overwritten whole by the node it holds)."""
    buffers = HostBuffers()
    made = []
    for update in range(2):
        leaves = _leaves(21, seed=10 + update)
        park = HostPark(lookahead=0, buffers=buffers)
        f = PairwiseFold(park=park)
        for v in leaves:
            f.leaf(v, owned=False)
        assert_bytes_equal(f.result(), tree_reference(leaves), f"update {update}")
        made.append(buffers.allocated)
        assert park.stats.parks > 0
    assert made[1] == made[0] > 0 and buffers.reused >= park.stats.parks


def test_trains_park_looks_one_micro_batch_ahead_unless_told() -> None:
    keys = [["a", "b"], ["c", "d", "e"], ["f"]]
    assert HostPark.for_micro_batches(keys).lookahead == 3 and HostPark.for_micro_batches(keys, 0).lookahead == 0


def test_parking_at_the_join_keeps_one_node_on_the_device() -> None:
    """Micro-batches that are level-1 nodes of the tree (the batched CFG layout folded in the graph): looking one
    micro-batch ahead keeps up to three nodes of the fold on the device; with no lookahead one, the same bytes."""
    leaves = _leaves(64, seed=5)
    pairs = [leaves[i] + leaves[i + 1] for i in range(0, 64, 2)]  # 32 level-1 nodes, one per micro-batch
    device_nodes, results = {}, {}
    for ahead in (None, 0):
        park = HostPark.for_micro_batches([["k", "k2"]] * 32, ahead)
        f = PairwiseFold(park=park)
        most = 0
        for m, v in enumerate(pairs):
            f.push(Node(1, 2 * m, v, owned=False))
            most = max(most, sum(1 for n in f.nodes if n.value is not None and not park.parked(n)))
        device_nodes[ahead], results[ahead] = most, f.result()
        if ahead == 0:  # nothing copied back: each parked node was added into its sibling from the host
            assert park.stats.added_from_host == park.stats.fetches == park.stats.parks == 15
        else:  # nodes that join within a micro-batch stay: fewer parks
            assert park.stats.parks == 7
    assert device_nodes == {None: 3, 0: 1}
    assert_bytes_equal(results[0], results[None], "parked at the join vs one micro-batch ahead")


def test_a_sum_the_next_push_would_park_is_parked_at_once() -> None:
    """A fold that knows where its leaves end parks a fresh sum right away where the next node pushed would cover it
    and park it anyway: the same 15 parks at the join, each one push sooner, so after every second push (a sum) nothing
    of the fold is on the device. A sum that reaches the end (the root) or joins within the lookahead stays."""
    leaves = _leaves(64, seed=5)
    pairs = [leaves[i] + leaves[i + 1] for i in range(0, 64, 2)]
    results, on_device = {}, {}
    for ahead, end in ((0, 64), (0, None), (2, 64)):
        park = HostPark(lookahead=ahead)
        f = PairwiseFold(park=park, end=end)
        counts = []
        for m, v in enumerate(pairs):
            f.push(Node(1, 2 * m, v, owned=False))
            counts.append(sum(1 for n in f.nodes if n.value is not None and not park.parked(n)))
        results[ahead, end], on_device[ahead, end] = f.result(), counts
        if ahead == 0:
            assert park.stats.parks == 15 and park.stats.added_from_host == 15
    assert on_device[0, 64][1:31:2] == [0] * 15 and on_device[0, 64][31] == 1  # the root reaches the end: it stays
    assert on_device[0, None][1:31:2] == [1] * 15  # without the end known, a sum waits to be covered
    assert max(on_device[2, 64]) == 3  # looking one push ahead: sums that join at the next push stay, as before
    for key, got in results.items():
        assert_bytes_equal(got, results[0, None], f"lookahead {key[0]}, end {key[1]}")
    with pytest.raises(ValueError, match="comes before its first leaf"):
        PairwiseFold(first=4, end=2)


@pytest.mark.gpu
def test_gpu_parked_fold_same_bytes_less_device_memory() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    leaves = [torch.randn(1 << 20, device="cuda", generator=g) * 2.0 ** (i % 9 - 4) for i in range(63)]
    torch.cuda.synchronize()
    peaks, results = {}, {}
    for name, park in (("plain", None), ("parked", HostPark(lookahead=4))):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        peak = 0
        f = PairwiseFold(park=park)
        for v in leaves:
            f.leaf(v, owned=False)
            peak = max(peak, torch.cuda.memory_allocated() - base)
        results[name] = f.result()
        torch.cuda.synchronize()
        peaks[name] = peak
    assert_bytes_equal(results["parked"], results["plain"], "63 leaves of 4 MiB")
    # 63 leaves: 6 open nodes at the end unparked; parked, levels 0-2, the one prefetched for the next join and
    # what a finished copy out has not given back yet (the allocator frees a block once its stream event is seen),
    # beside the park's two chunk buffers for joins from the host (kept: at this size each is a whole node)
    chunks = 2 * min(HostPark.CHUNK_BYTES, 1 << 22)
    assert peaks["parked"] - chunks <= peaks["plain"] - (1 << 22), peaks


@pytest.mark.gpu
def test_gpu_parked_nodes_join_from_the_host_in_chunks() -> None:
    """No lookahead: every parked node is added into its sibling from pinned memory in chunks (here 1 MiB, so each
    4 MiB node is four copies and adds on two buffers); the same bytes as the unparked fold, and at most the node
    being written, the settled copy of a leaf, a parked node whose copy out has not given its block back yet, and the
    chunk buffers on the device."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator(device="cuda").manual_seed(1)
    leaves = [torch.randn(1 << 20, device="cuda", generator=g) * 2.0 ** (i % 7 - 3) for i in range(40)]
    plain = PairwiseFold()
    for v in leaves:
        plain.leaf(v, owned=False)
    want = plain.result()
    park = HostPark(lookahead=0)
    park.CHUNK_BYTES = 1 << 20
    f = PairwiseFold(park=park)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for v in leaves:
        f.leaf(v, owned=False)
    got = f.result()
    torch.cuda.synchronize()
    assert_bytes_equal(got, want, "40 leaves of 4 MiB, parked nodes joined from the host")
    assert park.stats.added_from_host == park.stats.fetches > 0 and park.stats.prefetched == 0
    node, chunks = 1 << 22, 2 << 20
    assert torch.cuda.max_memory_allocated() - base <= 3 * node + chunks, "more than three nodes on the device at once"


@pytest.mark.gpu
def test_gpu_host_buffer_is_not_reused_before_its_copy_has_read_it() -> None:
    """A pinned buffer handed back with the event of a copy still queued behind a long kernel is not handed out
    again until that event has passed; then it is."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    buffers = HostBuffers()
    buf = buffers.take(1 << 20, torch.float32, pinned=True)
    assert buf.is_pinned() and buffers.allocated == 1
    dst = torch.empty(1 << 20, device="cuda")
    torch.cuda._sleep(200_000_000)  # keeps the stream busy well past the next lines
    dst.copy_(buf, non_blocking=True)
    read = torch.cuda.Event()
    read.record()
    buffers.give(buf, read)
    other = buffers.take(1 << 20, torch.float32, pinned=True)
    assert other.data_ptr() != buf.data_ptr() and buffers.allocated == 2 and buffers.reused == 0
    torch.cuda.synchronize()
    again = buffers.take(1 << 20, torch.float32, pinned=True)
    assert again.data_ptr() == buf.data_ptr() and buffers.reused == 1

"""The cross-rank gradient merge on a real gloo group (3 CPU processes, no model).

Ranks own consecutive leaf ranges of one fold — one range empty, sizes not powers of two — and
:func:`~mmdit_strict.distributed.fold.merge_update` must hand every rank the tree fold of all leaves
(the independent recursive reference), with no rank sending a per-leaf partial.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp

from tests.harness import assert_bytes_equal
from tests.kernels.test_fold_tree import _leaves, tree_reference

BOUNDS = [0, 5, 5, 11]  # rank r owns leaves [BOUNDS[r], BOUNDS[r + 1])


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from mmdit_strict import distributed
    from mmdit_strict.distributed.fold import merge_update
    from mmdit_strict.kernels.fold_tree import PairwiseFold

    leaves = {"a": _leaves(11, seed=7, empty=(3,)), "b": _leaves(11, seed=8)}
    lo, hi = BOUNDS[rank], BOUNDS[rank + 1]
    with distributed.session(60.0) as sess:
        nodes = {}
        for name, vals in leaves.items():
            f = PairwiseFold(lo)
            for v in vals[lo:hi]:
                f.leaf(None if v is None else v.clone())
            nodes[name] = f.nodes
        got = merge_update(["a", "b"], nodes, lo, "test merge")
        torch.save({"got": got, "bytes_out": sess.traffic.bytes_out, "bytes_in": sess.traffic.bytes_in}, Path(out) / f"{rank}.pt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranges_merged_across_ranks_give_every_rank_the_single_fold(tmp_path: Path) -> None:
    world = len(BOUNDS) - 1
    mp.spawn(_rank, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    want = {"a": tree_reference(_leaves(11, seed=7, empty=(3,))), "b": tree_reference(_leaves(11, seed=8))}
    leaf_bytes = 6 * 5 * 4
    for r in range(world):
        res = torch.load(tmp_path / f"{r}.pt")
        for name in want:
            assert_bytes_equal(res["got"][name], want[name], f"rank {r} {name}")
        # rank 2 (leaves 5..10) sends its complete nodes [5], [6,8), [8,10), [10] per tensor, each one leaf's size
        if r == 2:
            assert res["bytes_out"] == 4 * 2 * leaf_bytes
        if r != 0:
            assert res["bytes_in"] == 2 * leaf_bytes  # the result of both tensors, from rank 0

"""The pairwise fold tree: streaming leaf by leaf, or range by range (as ranks do), gives the tree's bytes.

``tree_reference`` is the definition written independently: recursion over the power-of-two padded
range, ``[lo, hi) = [lo, mid) + [mid, hi)`` with an empty half taking the other half's value.
"""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.kernels.fold_tree import Node, PairwiseFold, fold
from tests.harness import assert_bytes_equal


def tree_reference(leaves: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The canonical tree fold, by recursion (the independent reference)."""
    size = 1
    while size < len(leaves):
        size *= 2

    def node(lo: int, width: int) -> torch.Tensor | None:
        if lo >= len(leaves):
            return None
        if width == 1:
            return leaves[lo]
        left, right = node(lo, width // 2), node(lo + width // 2, width // 2)
        if left is None or right is None:
            return right if left is None else left
        return left + right

    return node(0, size) if leaves else None


def _leaves(n: int, seed: int, empty: tuple[int, ...] = ()) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor | None] = []
    for i in range(n):
        mag = torch.exp2(torch.randint(-14, 14, (6, 5), generator=g).float())
        out.append(None if i in empty else torch.randn(6, 5, generator=g) * mag)
    return out


def _range_nodes(leaves, lo: int, hi: int) -> list[Node]:
    """What one rank hands over for leaves [lo, hi): its open nodes after folding them in order."""
    f = PairwiseFold(lo)
    for v in leaves[lo:hi]:
        f.leaf(None if v is None else v.clone())
    return f.nodes


def test_small_trees_have_the_stated_shape() -> None:
    a, b, c, d, e, f, g = (torch.tensor([2.0**k, 1.0]) for k in (24, -3, 1, 0, -24, 5, 23))
    assert_bytes_equal(fold([a, b, c, d, e, f]), ((a + b) + (c + d)) + (e + f), "K=6")
    assert_bytes_equal(fold([a, b, c, d, e, f, g]), ((a + b) + (c + d)) + ((e + f) + g), "K=7")
    assert_bytes_equal(fold([a, None, c]), a + c, "an empty leaf")
    assert fold([]) is None and fold([None, None]) is None


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 24, 33])
def test_streamed_fold_is_the_reference_tree_and_leaves_inputs_alone(n: int) -> None:
    leaves = _leaves(n, seed=n, empty=(1, n // 2) if n > 4 else ())
    before = [None if v is None else v.clone() for v in leaves]
    got = fold(leaves)
    assert_bytes_equal(got, tree_reference(leaves), f"{n} leaves")
    for v, w in zip(leaves, before):
        assert (v is None and w is None) or torch.equal(v, w), "fold() wrote into a caller's tensor"
    if n >= 8:
        acc = None
        for v in leaves:
            acc = v if acc is None else (acc if v is None else acc + v)
        assert not torch.equal(acc, got), "inputs too tame: the left fold gives the tree's bytes"


@pytest.mark.parametrize("n, cuts", [(24, (12,)), (24, (5, 11, 19)), (48, (1, 2, 30, 47)), (7, (3,)), (9, (0, 4, 4, 9))])
def test_ranges_folded_apart_and_merged_give_the_whole_tree(n: int, cuts: tuple[int, ...]) -> None:
    """Ranks own contiguous ranges (empty ones too): merging their nodes left to right gives the single fold."""
    leaves = _leaves(n, seed=100 + n, empty=(2,))
    bounds = [0, *cuts, n]
    parts = [_range_nodes(leaves, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    for nodes in parts:  # a range reduces to at most 2·ceil(log2 n) nodes
        assert len(nodes) <= 2 * max(1, (n - 1).bit_length())
    merged = PairwiseFold()
    for nodes in parts:
        merged.extend(nodes)
    assert_bytes_equal(merged.result(), tree_reference(leaves), f"{n} leaves cut at {cuts}")
    # pairwise merging (rank 0 ← 1, 2 ← 3, then 0 ← 2), as a tree of ranks does
    if len(parts) == 4:
        left, right = PairwiseFold(), PairwiseFold(bounds[2])
        for nodes in _range_nodes(leaves, 0, bounds[1]), _range_nodes(leaves, bounds[1], bounds[2]):
            left.extend(nodes)
        for nodes in _range_nodes(leaves, bounds[2], bounds[3]), _range_nodes(leaves, bounds[3], n):
            right.extend(nodes)
        left.extend(right.nodes)
        assert_bytes_equal(left.result(), tree_reference(leaves), "tree of ranks")


def test_bad_node_sequences_are_refused() -> None:
    f = PairwiseFold(4)
    with pytest.raises(ValueError, match="expected 4"):
        f.push(Node(0, 5, torch.ones(1)))
    with pytest.raises(ValueError, match="not aligned"):
        f.push(Node(3, 4, torch.ones(1)))
    with pytest.raises(ValueError, match="every leaf from 0"):
        f.result()


def test_a_borrowed_leaf_joined_before_settle_is_never_copied() -> None:
    """``settle=False`` leaves a caller's tensor on the stack as it is; joined with an owned sibling, the sum goes
    into the sibling (``b + a`` has the bytes of ``a + b``), so nothing is allocated and the caller's tensor is
    untouched; a borrowed node still waiting at :meth:`settle` is copied."""
    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.randn(33, generator=g) * torch.exp2(torch.randint(-20, 20, (33,), generator=g).float())
               for _ in range(3))
    a_before = a.clone()
    f = PairwiseFold()
    f.leaf(a, owned=False, settle=False)
    assert f.nodes[0].value is a  # not copied yet
    mine = b.clone()
    f.leaf(mine, owned=True, settle=False)
    assert len(f.nodes) == 1 and f.nodes[0].value is mine and f.nodes[0].owned
    assert_bytes_equal(mine, a_before + b, "b + a in place")
    assert_bytes_equal(a, a_before, "the borrowed leaf")
    c_before = c.clone()
    f.leaf(c, owned=False, settle=False)
    assert f.nodes[-1].value is c
    f.settle()
    assert f.nodes[-1].value is not c and f.nodes[-1].owned
    c.fill_(0.0)  # the caller may reuse its tensor once the call has settled
    assert_bytes_equal(f.result(), fold([a_before, b, c_before]), "root")

"""The fixed pairwise tree that folds per-sample gradient partials, built leaf by leaf.

The leaves are the sorted sample keys of one fold, at indices ``0..K-1``. The tree is the canonical
dyadic one: node ``(level l, start s)`` covers leaves ``[s, s + 2^l)`` (``s`` a multiple of ``2^l``)
and its value is ``left + right`` (FP32, elementwise) of its two halves; a half holding no partial is
empty and the node takes the other half as it is. Above the largest complete node the remaining
nodes are added right to left, which is the same tree padded with empty leaves to a power of two:
for ``K = 6``, ``root = [0,4) + [4,6)``; for ``K = 7``, ``root = [0,4) + ([4,6) + [6,7))``.

Why a tree and not a chain: a left fold ``((P0 + P1) + P2) + …`` cannot be cut at a rank boundary
and resumed elsewhere without holding the partials, while any contiguous range of leaves reduces
to at most ``2·⌈log2 K⌉`` complete nodes whose values do not depend on who computed them. So ranks
that each own a contiguous range of keys fold their own leaves, exchange those few nodes, and the
merged result is the single-process bytes (:mod:`mmdit_strict.distributed.fold`).

:class:`PairwiseFold` adds leaves (or whole nodes) in increasing position and merges two nodes as
soon as both halves of their parent are complete, like a binary counter: it holds at most
``⌈log2 K⌉ + 1`` nodes per contiguous range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

if TYPE_CHECKING:
    from .fold_park import HostPark


@dataclass
class Node:
    """Leaves ``[start, start + 2**level)`` folded (``value`` None: none of them holds a partial)."""

    level: int
    start: int
    value: torch.Tensor | None
    owned: bool = True  # the fold may add into ``value`` in place (nobody else reads it)

    @property
    def stop(self) -> int:
        return self.start + (1 << self.level)


def _join(level: int, left: Node, right: Node, inplace: bool) -> Node:
    """The parent (or, above the complete nodes, the right-to-left sum) of ``left`` and ``right``: ``left + right``.

    In place into whichever operand the fold owns: IEEE-754 addition is commutative, so ``right + left`` has the
    bytes of ``left + right`` (a NaN stays a NaN; only its payload bits may come from the other operand)."""
    if left.value is None:
        return Node(level, left.start, right.value, right.owned)
    if right.value is None:
        return Node(level, left.start, left.value, left.owned)
    if inplace and left.owned:
        return Node(level, left.start, left.value.add_(right.value), True)
    if inplace and right.owned:
        return Node(level, left.start, right.value.add_(left.value), True)
    return Node(level, left.start, left.value + right.value, True)


class PairwiseFold:
    """One tensor's fold over a contiguous range of leaves, fed in increasing position.

    Args:
        first: index of the first leaf this fold receives (a rank's first key in the global order).
        inplace: add into the left operand when the fold owns it (see :attr:`Node.owned`), else
            allocate each sum. Same bytes either way.
        copy_held: a node the fold does not own is copied when it must wait on the stack for its
            sibling (a caller's tensor is only read at once, never kept); else it is held as it is.
        park: where a node covered by a newer one waits (:class:`~.fold_park.HostPark`: host memory,
            brought back before its join); None keeps every node where it is. Same bytes either way.
        end: the index after the last leaf this fold will receive, where known. With a park, a sum on top of the
            stack that would be parked under the next node pushed (one of the size just pushed) is parked at once,
            unless it reaches ``end``: the device is then rid of it while the next node is being computed.
    """

    def __init__(self, first: int = 0, inplace: bool = True, copy_held: bool = True,
                 park: "HostPark | None" = None, end: int | None = None) -> None:
        if first < 0:
            raise ValueError(f"first leaf index must be >= 0, got {first}")
        if end is not None and end < first:
            raise ValueError(f"the fold's end ({end}) comes before its first leaf ({first})")
        self.first = first
        self.next = first
        self.inplace = inplace
        self.copy_held = copy_held
        self.park = park
        self.end = end
        self.nodes: list[Node] = []

    def leaf(self, value: torch.Tensor | None, owned: bool = True, settle: bool = True) -> None:
        """Add the next leaf (None: its key deposited nothing into this tensor; ``owned=False``: never written)."""
        self.push(Node(0, self.next, value, owned), settle)

    def push(self, node: Node, settle: bool = True) -> None:
        """Add a complete node starting where this fold's range ends (merging with the nodes before it).

        ``settle=False``: a node the fold does not own may stay on the stack as it is until :meth:`settle` (the
        caller keeps it unchanged until then), so a leaf joined by the next one pushed before that is never copied.
        """
        if node.start != self.next:
            raise ValueError(f"fold node starts at leaf {node.start}, expected {self.next}: nodes must come in order, without gaps")
        if node.start % (1 << node.level):
            raise ValueError(f"fold node (level {node.level}, start {node.start}) is not aligned to its size")
        self.next = node.stop
        pushed = node.level
        while self.nodes:
            top = self.nodes[-1]
            if top.level != node.level or top.stop != node.start or (top.start >> top.level) & 1:
                break
            self.nodes.pop()
            node = self._merge(top.level + 1, top, node)
        if settle and self.copy_held:
            node = self._own(node)
        if self.park is not None and self.nodes and not self._due(self.nodes[-1]):
            # the top is covered: it waits for a whole sibling subtree (unless that is within the lookahead)
            self.nodes[-1] = self.park.park(self._own(self.nodes[-1]))
        if (self.park is not None and node.level > pushed and node.owned and node.value is not None
                and self.end is not None and node.stop < self.end and not self._due(node, ahead=1 << pushed)):
            # a sum the next push would cover and park: parked now, so it is off the device during that push's work
            node = self.park.park(node)
        self.nodes.append(node)
        if self.park is not None:
            # only the parked node joined first comes back ahead of time; the ones below it are fetched when their
            # join comes, else every tensor's parked nodes would be back for the last joins of an update at once
            waiting = self.nodes[:-1]
            first = next((n for n in reversed(waiting) if self.park.parked(n)), None)
            if first is not None and self._due(first) and not any(self.park.returning(n) for n in waiting):
                self.park.prefetch(first)

    def settle(self) -> None:
        """Copy every node on the stack the fold does not own (``copy_held``): after this the caller's tensors are free."""
        if self.copy_held:
            self.nodes = [self._own(n) for n in self.nodes]

    @staticmethod
    def _own(node: Node) -> Node:
        if node.owned or node.value is None:
            return node
        return Node(node.level, node.start, node.value.clone(), True)

    def _due(self, node: Node, ahead: int = 0) -> bool:
        """Whether ``node`` joins within the park's lookahead (``ahead`` more leaves from now): node (l, s) joins when the
        leaves reach s + 2^(l+1)."""
        assert self.park is not None
        return self.next + ahead + self.park.lookahead >= node.start + (2 << node.level)

    def _merge(self, level: int, left: Node, right: Node) -> Node:
        """:func:`_join` of ``left`` (maybe parked) and ``right``: a parked ``left`` is added into ``right`` from the
        host when the fold owns ``right`` and adds in place, else brought back first."""
        if (self.park is not None and self.inplace and self.park.parked(left) and right.owned
                and right.value is not None):
            return Node(level, left.start, self.park.add_into(left, right.value), True)
        return _join(level, self._back(left), right, self.inplace)

    def _back(self, node: Node) -> Node:
        return node if self.park is None else self.park.fetch(node)

    def held(self) -> list[Node]:
        """The open nodes, every one on its device (parked ones brought back)."""
        self.nodes = [self._back(n) for n in self.nodes]
        return list(self.nodes)

    def split(self, spans: Sequence[tuple[int, int, torch.Size]]) -> list["PairwiseFold"]:
        """This fold of flat (1-D) values as one fold per ``(offset, numel, shape)`` span: the same nodes, each value
        the span's view, reshaped (parked nodes through the park). The spans must not overlap; each new fold then
        adds into its own part only, so together they go on as this one would have."""
        parts = [PairwiseFold(self.first, self.inplace, self.copy_held, self.park, self.end) for _ in spans]
        for f in parts:
            f.next = self.next
        for node in self.nodes:
            if self.park is not None and node.value is not None and self.park.holds(node):
                pieces = self.park.split(node, spans)
            else:
                pieces = [Node(node.level, node.start, None if node.value is None
                               else node.value[off:off + n].view(shape), node.owned) for off, n, shape in spans]
            for f, piece in zip(parts, pieces):
                f.nodes.append(piece)
        self.nodes = []
        return parts

    def extend(self, nodes: Iterable[Node]) -> None:
        """:meth:`push` each of ``nodes`` (another fold's nodes, the range right after this one)."""
        for n in nodes:
            self.push(n)

    def result(self) -> torch.Tensor | None:
        """The root, a tensor the caller owns: the remaining nodes added right to left (the range must start at leaf 0)."""
        if self.first != 0:
            raise ValueError(f"the root needs every leaf from 0; this fold starts at {self.first}")
        if not self.nodes:
            return None
        acc = self._back(self.nodes[-1])
        for n in reversed(self.nodes[:-1]):
            acc = self._merge(n.level, n, acc)
        self.nodes = []  # the fold has ended: its nodes were added into the root (parked ones from the host)
        if acc.value is not None and not acc.owned:
            return acc.value.clone()
        return acc.value


def fold(values: Iterable[torch.Tensor | None]) -> torch.Tensor | None:
    """The tree fold of ``values`` (leaves 0, 1, …; None for an empty leaf), without touching them."""
    f = PairwiseFold(copy_held=False)
    for v in values:
        f.leaf(v, owned=False)
    return f.result()

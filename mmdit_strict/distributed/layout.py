"""Which rank computes which sample: the split rule of a side across ranks (pure functions).

A side's single-process order is the order one process would visit the samples in: the rollout
visits sample positions ``0..N-1``; the recompute visits its shuffled order (``recompute.shuffle``,
``recompute.shuffle_seed``). That order is cut into ``world`` contiguous blocks of near-equal length
(block ``r`` is ``order[r·N // world : (r+1)·N // world]``), rank ``r`` takes block ``r``, and cuts its
block into batches of the side's batch size (``rollout.batch_size`` / ``recompute.micro_batch``) as a
single process cuts the whole order. With ``world = 1`` this is exactly the single-process layout.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")


def block(n: int, world: int, rank: int) -> range:
    """Rank ``rank``'s contiguous block of ``n`` items split over ``world`` ranks (may be empty when n < world)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    return range(rank * n // world, (rank + 1) * n // world)


def cut(items: Sequence[T], size: int) -> list[list[T]]:
    """``items`` in batches of ``size`` (the last one shorter), in order."""
    if size < 1:
        raise ValueError(f"batch size must be >= 1, got {size}")
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


def rank_batches(order: Sequence[T], size: int, world: int, rank: int) -> list[list[T]]:
    """The batches rank ``rank`` runs: its block of ``order``, cut into batches of ``size``."""
    span = block(len(order), world, rank)
    return cut(list(order[span.start:span.stop]), size)


def owners(order: Sequence[int], world: int) -> dict[int, int]:
    """Item → the rank that computes it."""
    return {item: r for r in range(world) for item in order[block(len(order), world, r).start:block(len(order), world, r).stop]}

"""Per-sample row chunks and their fixed-order folds: the reduction trees of the row operators.

Every per-sample (or per-parameter) sum over rows in :mod:`.norms` and :mod:`.rope` follows one tree,
frozen here, that depends only on the sample's own row count::

    sample s, rows [start_s, end_s)
      chunks:  [start_s, start_s + CHUNK_ROWS), [start_s + CHUNK_ROWS, ...), ... (the last one shorter)
      level 1: in each chunk, the rows' FP32 terms chained in row order (acc = 0; acc = acc + term_r)
               by the operator's backward kernel, one program per chunk, written as one FP32 partial row
      level 2: the sample's chunk partials in tiles of FOLD_TILE chunks from its first chunk; each tile
               summed by one ``tl.sum`` over the tile (a fixed tree for the compiled kernel; rows past
               the sample's last chunk are exact zeros), tiles chained in order
      level 3 (parameters shared by all samples, e.g. an RMSNorm gain): the per-sample FP32 results
               folded left in sample-index order, acc = 0; acc = acc + P_0; acc = acc + P_1; ...

One cast to the storage dtype at the end. No atomics, no split across samples, no configuration
chosen from the number of rows or samples.

The chunk tables are built once per ``(seqlens, device, rows per chunk)`` and cached (:class:`ChunkTables`),
so a repeated call with the same ``seqlens`` does no host-to-device copy.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..keepalive import retain
from .bound import bound, cdiv

CHUNK_ROWS = 16  # frozen: rows per level-1 partial of every backward row reduction (changing it changes bytes)
FOLD_TILE = 64  # frozen: chunk partials per level-2 tile
# Columns per fold program; with FOLD_TILE and the 4 warps it fixes the tile's layout, hence its tl.sum tree (bytes).
# 16 columns give the LayerNorm's 6144 partial columns 384 programs (benchmarks/fold_probe; experiments/norms/).
_FOLD_BLOCK_N = 16
_FOLD_STAGES = 2  # the tile loop's software pipelining: when a tile is read, not what is summed


@dataclass(frozen=True)
class Chunks:
    """Chunks of ``rows`` rows anchored at each sample's first row.

    Attributes:
        table: (3, n) int32 on the device: first row, end row (exclusive), sample index of each chunk.
        first_chunk: (B + 1,) int32 on the device: chunk index where each sample's chunks begin.
        n: number of chunks (host int).
        samples: number of samples B (host int).
    """

    table: torch.Tensor
    first_chunk: torch.Tensor
    n: int
    samples: int


class ChunkTables:
    """Cache of :class:`Chunks` keyed by ``(seqlens, device, rows)``; bounded, droppable with :meth:`clear`."""

    def __init__(self, max_entries: int = 4096) -> None:
        self._entries: dict[tuple, Chunks] = {}
        self._max = max_entries
        self._lock = threading.Lock()

    def get(self, seqlens: tuple[int, ...], device: torch.device, rows: int) -> Chunks:
        key = (seqlens, str(device), rows)
        hit = self._entries.get(key)
        if hit is not None:
            return retain(hit)
        firsts, ends, samples, first_chunk = [], [], [], [0]
        start = 0
        for s, n in enumerate(seqlens):
            for r0 in range(start, start + n, rows):
                firsts.append(r0)
                ends.append(min(r0 + rows, start + n))
                samples.append(s)
            first_chunk.append(len(firsts))
            start += n
        host = torch.tensor([firsts, ends, samples], dtype=torch.int32).reshape(3, len(firsts))
        entry = Chunks(table=host.to(device), first_chunk=torch.tensor(first_chunk, dtype=torch.int32).to(device),
                       n=len(firsts), samples=len(seqlens))
        with self._lock:
            if len(self._entries) >= self._max:
                self._entries.clear()
            self._entries[key] = entry
        return retain(entry)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


TABLES = ChunkTables()


def check_seqlens(op: str, seqlens: object, rows: int) -> tuple[int, ...]:
    """``seqlens`` as a tuple of ints, checked to be non-negative and to sum to ``rows`` (ValueError naming ``op``)."""
    if not isinstance(seqlens, Sequence) or isinstance(seqlens, (str, bytes)):
        raise ValueError(f"{op}: expected seqlens as a sequence of non-negative ints, got {seqlens!r}")
    seq = tuple(int(s) for s in seqlens)
    if any(s < 0 for s in seq) or sum(seq) != rows:
        raise ValueError(f"{op}: seqlens {seq} must be non-negative and sum to the {rows} rows of x")
    return seq


def chunks(seqlens: tuple[int, ...], device: torch.device, rows: int = CHUNK_ROWS) -> Chunks:
    """The cached chunk table of ``seqlens`` on ``device``."""
    return TABLES.get(seqlens, device, rows)


@triton.jit
def _fold_tiles(part_ptr, c0, c1, cols, mask_n, stride_p, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr):
    """Level 2 for one sample: part[c0:c1, cols] in tiles of BLOCK_C rows from c0, each reduced by tl.sum over axis 0
    (rows past c1 load as 0), the tile sums chained in order from 0. FP32."""
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    offs_c = tl.arange(0, BLOCK_C)
    for t0 in range(c0, c1, BLOCK_C):
        rows = t0 + offs_c
        tile = tl.load(part_ptr + rows.to(tl.int64)[:, None] * stride_p + cols[None, :],
                       mask=(rows < c1)[:, None] & mask_n[None, :], other=0.0)
        acc = acc + tl.sum(tile, axis=0)
    return acc


@triton.jit(do_not_specialize=["n_groups"])
def _segment_fold_kernel(
    part_ptr, seg_ptr, out_ptr,
    N, stride_p, stride_o, n_groups,
    MODE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """MODE 0 (level 2): out[g, cols] = :func:`_fold_tiles` of part[seg[g]:seg[g+1], cols].
    MODE 1 (level 3): out[g, cols] = acc = 0; acc = acc + part[c] for c in seg[g]..seg[g+1] in order.
    MODE 2 (levels 2 and 3 in one launch): out[0, cols] = acc = 0; acc = acc + :func:`_fold_tiles` of group s, for
    s = 0 .. n_groups − 1 in order: the same operations as MODE 0 into FP32 rows, then MODE 1 over those rows.
    FP32; one cast at the store. n_groups is a runtime value (never specialized: one binary for any batch)."""
    pid_n = tl.program_id(0)
    g = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < N
    if MODE == 2:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for s in range(0, n_groups):
            acc = acc + _fold_tiles(part_ptr, tl.load(seg_ptr + s), tl.load(seg_ptr + s + 1), cols, mask_n, stride_p,
                                    BLOCK_C, BLOCK_N)
    elif MODE == 1:
        c0 = tl.load(seg_ptr + g)
        c1 = tl.load(seg_ptr + g + 1)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        base = c0.to(tl.int64)
        for i in range(0, c1 - c0):
            acc = acc + tl.load(part_ptr + (base + i) * stride_p + cols, mask=mask_n, other=0.0)
    else:
        acc = _fold_tiles(part_ptr, tl.load(seg_ptr + g), tl.load(seg_ptr + g + 1), cols, mask_n, stride_p,
                          BLOCK_C, BLOCK_N)
    tl.store(out_ptr + g.to(tl.int64) * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


TILES, CHAIN, NESTED = 0, 1, 2  # _segment_fold_kernel's modes


def _launch_fold(part: torch.Tensor, seg: torch.Tensor, groups: int, out: torch.Tensor, mode: int, interpreting: bool,
                 *, block_n: int = _FOLD_BLOCK_N, warps: int = 4, stages: int = _FOLD_STAGES) -> None:
    """The fold of ``part``'s rows ``seg[g]:seg[g+1]`` into ``out[g]`` for each of ``groups``: level 2 (``mode``
    :data:`TILES`), level 3 (:data:`CHAIN`), or with :data:`NESTED` both levels over all ``groups`` into ``out[0]``
    in one launch. ``block_n`` and ``warps`` fix the tile's layout (its tl.sum tree); the product takes the
    defaults, benchmarks pass others."""
    n = part.shape[1]
    if groups == 0 or n == 0:
        return
    opts = {} if interpreting else {"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False}
    bound(_segment_fold_kernel)[(cdiv(n, block_n), 1 if mode == NESTED else groups)](
        part, seg, out, n, part.stride(0), out.stride(0), groups,
        MODE=mode, BLOCK_C=FOLD_TILE, BLOCK_N=block_n, **opts,
    )


def per_sample_sums(part: torch.Tensor, ch: Chunks, dtype: torch.dtype, interpreting: bool) -> torch.Tensor:
    """Level 2: chunk partials ``part (n_chunks, N)`` FP32 → ``(B, N)`` per-sample sums in ``dtype``.

    A sample with no rows gets zeros."""
    if ch.n == 0:
        return torch.zeros((ch.samples, part.shape[1]), dtype=dtype, device=part.device)
    out = torch.empty((ch.samples, part.shape[1]), dtype=dtype, device=part.device)
    if ch.samples:
        _launch_fold(part, ch.first_chunk, ch.samples, out, TILES, interpreting)
    return out


def total_sum(part: torch.Tensor, ch: Chunks, dtype: torch.dtype, interpreting: bool) -> torch.Tensor:
    """Levels 2 and 3: chunk partials ``(n_chunks, N)`` → per-sample FP32 sums folded in sample order → ``(N,)``.

    One launch: each program keeps its columns' per-sample sums in registers instead of writing them out and
    folding them in a second kernel; the operations and their order are those of :func:`per_sample_sums` into FP32
    followed by the level-3 chain (tested byte for byte on the GPU and in the interpreter)."""
    n = part.shape[1]
    if ch.n == 0:
        return torch.zeros((n,), dtype=dtype, device=part.device)
    out = torch.empty((1, n), dtype=dtype, device=part.device)
    _launch_fold(part, ch.first_chunk, ch.samples, out, NESTED, interpreting)
    return out.reshape(n)

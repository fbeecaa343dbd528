"""Batch-invariant building blocks of the CPU strict backend.

Three facts about CPU PyTorch that this module is built around (measured on the team's machines,
docs/design.md §7, and by ``tests/kernels``):

1. ``x @ W`` is not row-invariant: BLAS picks kernels and blockings by M. A product done as
   fixed-shape tiles — rows zero-padded to a multiple of ``TILE_M``, one ``(TILE_M, K) @ (K, N)``
   product per tile (``bmm`` over a freshly allocated, 64-byte aligned buffer) — is.
2. Vectorised transcendental kernels (SiLU, GELU) handle a tensor's tail with scalar code that
   rounds differently. :func:`elementwise` pads the last dim to a multiple of 64 and applies the
   function on row blocks of at most 32768 elements, so every element takes the vector path.
3. Reductions over rows must not depend on other samples. :func:`segment_tree_sum` sums each
   sample's rows with a pairwise halving tree over the sample's rows zero-padded to a power of two;
   extra padding only adds exact zeros at the top of the tree, so the result depends only on the
   sample's own rows. :func:`fold` combines per-sample partials in sample-index order.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from ..keepalive import retain

TILE_M = 32  # rows per GEMM tile; frozen (changing it changes bytes)
VEC_PAD = 64  # last-dim padding for elementwise transcendentals
ELEMWISE_BLOCK = 32768  # elements per elementwise call (one ATen chunk, no thread split)


def check_seqlens(seqlens: Sequence[int], rows: int, what: str = "x") -> tuple[int, ...]:
    seq = tuple(int(s) for s in seqlens)
    if any(s < 0 for s in seq) or sum(seq) != rows:
        raise ValueError(f"seqlens {seq} must be non-negative and sum to the {rows} rows of {what}")
    return seq


def tile_matmul(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """``x (M, K) @ w_t (K, N)`` as fixed ``(TILE_M, K) @ (K, N)`` tiles; row bytes independent of M."""
    M, K = x.shape
    N = w_t.shape[1]
    tiles = max(1, -(-M // TILE_M))
    buf = x.new_zeros(tiles * TILE_M, K)
    buf[:M] = x
    out = torch.bmm(buf.view(tiles, TILE_M, K), w_t.expand(tiles, K, N))
    return out.reshape(tiles * TILE_M, N)[:M]


def segment_tree_sum(x: torch.Tensor, seqlens: Sequence[int]) -> torch.Tensor:
    """Per-sample sum over rows: ``x (M, ...)`` → ``(B, ...)`` with a pairwise halving tree.

    Sample ``s``'s rows are placed in a zero buffer of ``P = 2^ceil(log2(max_len))`` rows; each level
    adds the upper half onto the lower half elementwise. The tree of a sample depends only on its
    own row count (extra zero levels are exact), so the bytes do not depend on the batch.
    """
    seq = tuple(seqlens)
    B = len(seq)
    tail = x.shape[1:]
    longest = max(seq) if seq else 0
    P = 1
    while P < longest:
        P *= 2
    buf = x.new_zeros((B, P) + tail)
    start = 0
    for b, n in enumerate(seq):
        buf[b, :n] = x[start:start + n]
        start += n
    while buf.shape[1] > 1:
        half = buf.shape[1] // 2
        buf = buf[:, :half] + buf[:, half:]
    return buf[:, 0]


def fold(partials: torch.Tensor) -> torch.Tensor:
    """Left fold over dim 0 in index order: ``((p0 + p1) + p2) + ...`` (FP32)."""
    acc = partials[0].clone()
    for i in range(1, partials.shape[0]):
        acc = acc + partials[i]
    return acc


def elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply an elementwise ``fn`` so that every element takes the same (vectorised) code path.

    Not differentiable by itself; wrap in an autograd function or use for forward-only values.
    """
    shape = x.shape
    D = shape[-1] if x.dim() else 1
    flat = x.reshape(-1, D)
    Dp = -(-D // VEC_PAD) * VEC_PAD
    rows = max(1, ELEMWISE_BLOCK // Dp)
    out = torch.empty_like(flat)
    for start in range(0, flat.shape[0], rows):
        blk = flat.new_zeros(rows, Dp)
        n = min(rows, flat.shape[0] - start)
        blk[:n, :D] = flat[start:start + n]
        out[start:start + n] = fn(blk)[:n, :D]
    return out.reshape(shape)


def silu_fwd(x: torch.Tensor) -> torch.Tensor:
    return elementwise(torch.nn.functional.silu, x)


def silu_bwd(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    s = elementwise(torch.sigmoid, x)
    return dy * (s * (1 + x * (1 - s)))


_GELU_C = 0.7978845608028654  # sqrt(2/pi)


def gelu_tanh_fwd(x: torch.Tensor) -> torch.Tensor:
    return elementwise(lambda t: torch.nn.functional.gelu(t, approximate="tanh"), x)


def gelu_tanh_bwd(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    inner = _GELU_C * (x + 0.044715 * x * x * x)
    t = elementwise(torch.tanh, inner)
    dinner = _GELU_C * (1 + 3 * 0.044715 * x * x)
    return dy * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * dinner)


@functools.lru_cache(maxsize=256)
def _row_sample_index(seqlens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(seqlens), device=device), torch.tensor(seqlens, device=device))


def row_sample_index(seqlens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """(M,) sample index of every packed row; cached per (seqlens, device), so built once per layout."""
    return retain(_row_sample_index(seqlens, device))


class BroadcastRows(torch.autograd.Function):
    """Per-sample vectors ``v (B, D)`` → rows ``(M, D)``; backward is :func:`segment_tree_sum`."""

    @staticmethod
    def forward(ctx, v: torch.Tensor, seqlens: tuple[int, ...]) -> torch.Tensor:  # type: ignore[override]
        ctx.seqlens = seqlens
        return v.index_select(0, row_sample_index(seqlens, v.device))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        return segment_tree_sum(dy, ctx.seqlens), None


class BroadcastParam(torch.autograd.Function):
    """A parameter ``p (D,)`` broadcast to every row ``(R, D)``; backward: per-sample trees, then fold.

    ``row_seqlens`` are rows per sample (for per-head params: tokens × heads).
    """

    @staticmethod
    def forward(ctx, p: torch.Tensor, rows: int, row_seqlens: tuple[int, ...]) -> torch.Tensor:  # type: ignore[override]
        ctx.row_seqlens = row_seqlens
        return p.expand(rows, -1)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        return fold(segment_tree_sum(dy.contiguous(), ctx.row_seqlens)), None, None


def broadcast_rows(v: torch.Tensor, seqlens: tuple[int, ...]) -> torch.Tensor:
    return BroadcastRows.apply(v, seqlens)


def broadcast_param(p: torch.Tensor, rows: int, row_seqlens: tuple[int, ...]) -> torch.Tensor:
    return BroadcastParam.apply(p, rows, row_seqlens)


def layer_norm_rows(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Parameter-free LayerNorm over the last dim, composed of row-local ops (autograd-friendly)."""
    mu = x.mean(dim=-1, keepdim=True)
    xc = x - mu
    var = (xc * xc).mean(dim=-1, keepdim=True)
    return xc * torch.rsqrt(var + eps)


def rms_norm_rows(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Gain-free RMSNorm over the last dim (row-local ops)."""
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps)

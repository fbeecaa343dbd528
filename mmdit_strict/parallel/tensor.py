"""Tensor parallelism without a collective sum: every GEMM of a block is split by output columns.

A ``tp`` group shares each product by its output features: rank ``j`` computes columns
``[j·N/tp, (j+1)·N/tp)`` with the whole reduction length K. The Q/K/V products keep their column shard
(this rank's attention heads: attention is per head; the Q/K norm + RoPE kernels, whose tile follows the
head count, run in this rank's slots of an all-heads buffer, :meth:`ColumnShards.spread_heads`); the attention output
projection, the MLP up (+ tanh-GELU) and the MLP down products gather their shards' columns in rank order,
so their inputs and outputs are whole on every rank (the all-gather formulation). No product ever splits K,
so no rank adds another rank's partial sums: a shard's columns are the whole product's columns when the
GEMM gives every column the same arithmetic whatever the product's width. That is checked, not assumed
(:meth:`ColumnShards.check`): the first time a layer shape is sharded, a probe of 32 rows runs the whole
product and every shard through the operator in force and compares raw bytes; a platform where they
differ (a CPU BLAS whose column blocking is not a divisor of the shard width) is refused by name.
Replicated on every rank of the group: the modulation projections, norms, gates and residuals, and the
timestep, text-input and output projections.

The backward is the one-rank block's, as for sequence shards (:class:`~.sequence.ShardedBlock`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..kernels.execution import bind, current
from ..kernels.streams import gemm_columns
from ..model.strict import gemm_params, linear_params
from .exchange import all_gather
from .groups import ModelParallel

PROBE_ROWS = 32


class ColumnShards:
    """This rank's column shard of every GEMM of the model (``mp.tp`` ranks)."""

    def __init__(self, mp: ModelParallel) -> None:
        self.mp = mp
        self.size = mp.tp
        self.rank = mp.tp_rank
        self._views: dict[int, tuple[tuple, tuple]] = {}  # id(weight) → (its version key, its shard views)

    def bounds(self, n: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``n`` output columns."""
        if n % self.size:
            raise ValueError(f"parallel.tp={self.size} must divide every sharded layer's output features, got {n}")
        step = n // self.size
        return self.rank * step, (self.rank + 1) * step

    def _shard(self, op: str, x: torch.Tensor, module: torch.nn.Module, stream: str, kw: dict) -> tuple:
        """This rank's ``(weight, bias, lora)`` views of ``module``, made (and the layer shape probed) once per
        weight version: the same objects each call, so the engine's per-weight caches hold."""
        w, b, lora = linear_params(module)
        hit = self._views.get(id(w))
        key = (w._version, w.data_ptr(), None if lora is None else (lora[1]._version, lora[1].data_ptr(), lora[2]))
        if hit is not None and hit[0] == key:
            return hit[1]
        self.check(op, x, module, stream, kw)
        part = _columns(w, b, lora, *self.bounds(w.shape[0]))
        self._views[id(w)] = (key, part)
        return part

    def local(self, op: str, where: str, x: torch.Tensor, module: torch.nn.Module, seqlens: tuple[int, ...],
              stream: str = "image", **kw: Any) -> torch.Tensor:
        """This rank's columns of ``module``'s product ``(M, N/tp)`` (the Q/K/V heads this rank attends)."""
        ws, bs, ls = self._shard(op, x, module, stream, kw)
        with gemm_columns(ws.shape[0] * self.size):
            return gemm_params(op, where, x, ws, bs, ls, seqlens, stream, **kw)

    def whole(self, op: str, where: str, x: torch.Tensor, module: torch.nn.Module, seqlens: tuple[int, ...],
              stream: str = "image", **kw: Any) -> torch.Tensor:
        """``module``'s whole product ``(M, N)`` on every rank: this rank's columns, gathered in rank order."""
        return self.gather(self.local(op, where, x, module, seqlens, stream, **kw))

    def spread_heads(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's heads ``(M, h, d)`` at their places among all ``h · tp`` heads, zeros elsewhere.

        The Q/K RMSNorm + RoPE kernels tile a token's heads by the head count (the tile's layout fixes each
        head's sum-of-squares tree), so they run on every head's slot, as on one rank; the other ranks'
        slots hold zeros and are dropped by :meth:`own_heads`."""
        if self.size == 1:
            return t
        h = t.shape[1]
        full = t.new_zeros(t.shape[0], h * self.size, t.shape[2])
        full[:, self.rank * h:(self.rank + 1) * h] = t
        return full

    def own_heads(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's heads of ``(M, h · tp, d)``, contiguous."""
        if self.size == 1:
            return t
        h = t.shape[1] // self.size
        return t[:, self.rank * h:(self.rank + 1) * h].contiguous()

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's columns ``(M, N/tp)`` → ``(M, N)`` in rank order (attention heads: head order)."""
        if self.size == 1:
            return part
        parts = all_gather(self.mp, part, self.mp.tp_group, self.size, [part.shape[0]] * self.size)
        return torch.cat(parts, dim=1)

    def check(self, op: str, x: torch.Tensor, module: torch.nn.Module, stream: str, kw: dict) -> None:
        """Refuse (ValueError) when a column shard of this layer's product is not the whole product's columns
        on this platform and backend. Probed once per layer shape; every rank probes every shard, so the
        group decides alike."""
        w, b, lora = linear_params(module)
        key = (op, tuple(w.shape), x.dtype, x.device.type, stream, b is not None,
               None if lora is None else lora[0].shape[0], tuple(sorted(kw.items())), self.size)
        verdict = _PROBED.get(key)
        if verdict is None:
            verdict = _PROBED[key] = _probe(op, w, b, lora, x, stream, kw, self.size)
        if verdict:
            raise ValueError(f"parallel.tp={self.size}: {verdict} — this platform's {op} cannot be split by columns "
                             f"without changing bytes; use parallel.tp=1 here")


_PROBED: dict[tuple, str] = {}


def _columns(w: torch.Tensor, b: torch.Tensor | None, lora: tuple | None, lo: int, hi: int) -> tuple:
    """Columns ``[lo, hi)`` of a layer's ``(weight, bias, lora)``: views (rows of ``(N, K)`` are contiguous)."""
    return w[lo:hi], None if b is None else b[lo:hi], None if lora is None else (lora[0], lora[1][lo:hi], lora[2])


def _probe(op: str, w: torch.Tensor, b: torch.Tensor | None, lora: tuple | None, x: torch.Tensor, stream: str,
           kw: dict, size: int) -> str:
    """'' when every shard's product equals its columns of the whole product (raw bytes), else what differs."""
    n, k = w.shape
    g = torch.Generator().manual_seed(n * 7919 + k)
    rows = torch.randn(PROBE_ROWS, k, generator=g).to(x.device, x.dtype)
    seq = (PROBE_ROWS,)
    quiet = current().replace(trace=None, gemm_calls=None, capture=None, fault=None, overlay=None, grad_sink=None,
                              sample_keys=None)  # the probe is no part of the run: nothing records it
    with torch.no_grad(), bind(quiet):
        whole = gemm_params(op, "tp_probe", rows, w, b, lora, seq, stream, **kw)
        step = n // size
        with gemm_columns(n):
            for j in range(size):
                lo, hi = j * step, (j + 1) * step
                part = gemm_params(op, "tp_probe", rows, *_columns(w, b, lora, lo, hi), seq, stream, **kw)
                if not torch.equal(part, whole[:, lo:hi]):
                    return f"the {n}x{k} product's shard {j} of {size} differs from its columns of the whole product"
    return ""


__all__ = ["ColumnShards"]

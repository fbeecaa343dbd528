"""Model parallelism that keeps one rank's bytes: CFG-, sequence- and tensor-parallel strict forwards (docs/parallel.md).

A side's ``parallel`` section (``tp``, ``sp``, ``cfg``) groups ``tp · sp · cfg`` ranks around one batch;
:func:`model_parallel` binds the layout for a side's forwards. Tensors cross ranks only by moving
(gather, all-to-all), never by a collective sum, and no GEMM splits its reduction, so every layout gives the one-rank bytes.
"""

from __future__ import annotations

from .groups import ModelParallel, active, build, model_parallel
from .layout import ModelLayout, packed_rows, row_shards

__all__ = ["ModelLayout", "ModelParallel", "active", "build", "model_parallel", "packed_rows", "row_shards"]

"""Which stream of the joint model a GEMM belongs to, and which layer a column-shard GEMM is part of, set
by the caller for a block of code.

The stream is the ``gemm_stream`` field of the execution context (:mod:`.execution`). The strict model
wraps its text-stream products in ``with gemm_stream("text"):``; the Triton GEMM engine then takes that
stream's tile (``configs.FWD_TEXT``) for the forward product. Host code only, no Triton import: the model
sets it on every backend, and backends without stream-specific launches ignore it. A stream never
changes the bytes of a product (its tiles keep the image stream's K step); it is chosen by where the
product sits in the model, never from the number of rows.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from .choice import ContextChoice
from .execution import GEMM_STREAMS, current, switch

STREAMS = GEMM_STREAMS
GEMM_STREAM = ContextChoice("gemm stream", STREAMS, "gemm_stream")


def gemm_stream(name: str) -> AbstractContextManager[None]:
    """Bind the GEMM stream (``"image"`` or ``"text"``) for the block; ValueError for another name."""
    if name not in STREAMS:
        raise ValueError(f"gemm stream must be one of {STREAMS}, got {name!r}")
    return switch("gemm_stream", name)


def current_gemm_stream() -> str:
    """The GEMM stream of the execution context in force (``"image"`` unless bound)."""
    return current().gemm_stream


def gemm_columns(n: int | None) -> AbstractContextManager[None]:
    """Declare the GEMMs of the block column shards of a layer with ``n`` output features (None: whole
    products). Tensor parallelism binds it so that a shard's configuration is the whole layer's."""
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"gemm columns must be a positive int or None, got {n!r}")
    return switch("gemm_columns", n)


def configured_columns(n: int) -> int:
    """The N a GEMM of ``n`` output features looks its configuration up by: the whole layer's when bound."""
    whole = current().gemm_columns
    return n if whole is None else whole

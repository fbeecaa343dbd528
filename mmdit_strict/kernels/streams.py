"""Which stream of the joint model a GEMM belongs to, set by the caller for a block of code.

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

"""The CPU strict backend: batch-invariant FP32 implementations of every model operator."""

from . import attention, embed, gemm, norms  # noqa: F401  (importing registers them)

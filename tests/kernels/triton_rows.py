"""The Triton row-operator modules (norms, rope, segments) as the tests use them.

Their mode is fixed for the whole session by ``tests/conftest.py``: without CUDA ``TRITON_INTERPRET=1``
is set before any kernel module is imported (interpreter, FP32); with CUDA they are the compiled kernels.
"""

from __future__ import annotations

from mmdit_strict.kernels.triton import gemm as G
from mmdit_strict.kernels.triton import norms as N
from mmdit_strict.kernels.triton import rope as R
from mmdit_strict.kernels.triton import segments as S

INTERPRET = G._interpreting()

__all__ = ["G", "N", "R", "S", "INTERPRET"]

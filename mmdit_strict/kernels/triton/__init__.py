"""Triton strict kernels: importing this package registers the CUDA strict implementations.

Raises ImportError where Triton is not installed; ``kernels.backends`` then leaves the CUDA strict
slots empty, so strict mode fails closed there.
"""

import triton  # noqa: F401  (ImportError here means: no Triton backend on this machine)

from . import attention, attention_unfused, embed, gemm, norms, rope  # noqa: F401

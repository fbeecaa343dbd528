"""Loads the Triton row-operator modules (norms, rope, segments) for the tests, in the right mode.

Without CUDA, ``TRITON_INTERPRET=1`` is set before Triton compiles anything and the modules are rebuilt
for the interpreter if an earlier import compiled them for a GPU (as tests/kernels/test_triton_gemm.py
does for the GEMM engine); with CUDA they are the compiled kernels.
"""

from __future__ import annotations

import importlib
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from mmdit_strict.kernels.triton import gemm as G  # noqa: E402
from mmdit_strict.kernels.triton import norms as N  # noqa: E402
from mmdit_strict.kernels.triton import rope as R  # noqa: E402
from mmdit_strict.kernels.triton import segments as S  # noqa: E402

INTERPRET = G._interpreting()
try:
    from triton.runtime.interpreter import InterpretedFunction

    if INTERPRET:
        if not isinstance(G._gemm_fwd_kernel, InterpretedFunction):
            G = importlib.reload(G)
        if not isinstance(S._segment_fold_kernel, InterpretedFunction):
            S = importlib.reload(S)
        if not isinstance(R._qk_norm_fwd_kernel, InterpretedFunction) or R.seg is not S:
            R = importlib.reload(R)
        if not isinstance(N._adaln_mod_fwd_kernel, InterpretedFunction) or N.gemm is not G.gemm or N.seg is not S \
                or N.rms_norm_rows is not R.rms_norm_rows:
            N = importlib.reload(N)
except ImportError:  # pragma: no cover - layout of triton's internals changed
    pass

__all__ = ["G", "N", "R", "S", "INTERPRET"]

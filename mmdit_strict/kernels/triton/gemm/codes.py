"""Named activation codes of the strict GEMM engine, shared by the host code and the kernels.

One code names one elementwise function applied in FP32: as the main kernel's ``PROLOGUE`` (on the
loaded input tile, before the dot), as its ``EPILOGUE`` (on the FP32 accumulator, before the one cast)
and as ``ACT`` of the elementwise passes. :class:`Act` is what the host code passes; the
``tl.constexpr`` mirrors below are what the kernels compare against (a ``@triton.jit`` function reads
only globals that are ``tl.constexpr`` instances). ``tests/kernels/test_triton_gemm.py`` checks that
the two spellings agree.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

import triton.language as tl


class Act(enum.IntEnum):
    """Elementwise function code (constexpr of the kernels; changing a value recompiles, never re-rounds)."""

    NONE = 0
    GELU_TANH = 1  # z / (1 + exp(−2c·(z + a z³))), c = √(2/π), a = 0.044715
    SILU = 2  # z / (1 + exp(−z))
    TIMES_SILU_GRAD = 3  # epilogue only: acc · silu'(aux), the backward of a SiLU prologue (dX)
    GATE_RESIDUAL = 4  # epilogue only: aux + gate[sample of the row] · y, y = acc rounded once to the output dtype


ACT_NONE = tl.constexpr(int(Act.NONE))
ACT_GELU_TANH = tl.constexpr(int(Act.GELU_TANH))
ACT_SILU = tl.constexpr(int(Act.SILU))
ACT_TIMES_SILU_GRAD = tl.constexpr(int(Act.TIMES_SILU_GRAD))
ACT_GATE_RESIDUAL = tl.constexpr(int(Act.GATE_RESIDUAL))

# The names the call contract (docs/operators.md) accepts, and the codes they run as.
PROLOGUES: Mapping[str, Act] = MappingProxyType({"none": Act.NONE, "silu": Act.SILU})
EPILOGUES: Mapping[str, Act] = MappingProxyType({"none": Act.NONE, "gelu_tanh": Act.GELU_TANH, "silu": Act.SILU})

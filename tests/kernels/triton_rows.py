"""The Triton kernel modules (GEMM engine, norms, rope, segments) as the tests use them, and the test mode.

Their mode is fixed for the whole session by ``tests/conftest.py``: without CUDA ``TRITON_INTERPRET=1``
is set before any kernel module is imported (interpreter, FP32); with CUDA they are the compiled kernels.
Every Triton test module takes its mode from here: ``interp`` marks an interpreter (CPU FP32) test, and a
``@pytest.mark.gpu`` test starts with :func:`skip_unless_compiled` for one of :data:`GPU_TARGETS`
(:func:`on_gpu_targets` marks a test and runs it for each).
"""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.kernels.triton import gemm as G
from mmdit_strict.kernels.triton import norms as N
from mmdit_strict.kernels.triton import rope as R
from mmdit_strict.kernels.triton import segments as S
from tests.harness import Target

INTERPRET = G.interpreting()

interp = pytest.mark.skipif(not INTERPRET, reason="interpreter (CPU FP32) test; CUDA runs the gpu tests")

GPU_TARGETS = [Target("cuda", torch.bfloat16), Target("cuda", torch.float32)]


def on_gpu_targets(test):
    """``@pytest.mark.gpu`` and one run per :data:`GPU_TARGETS` (argument ``target``, ids bf16 / fp32); the
    test still starts with :func:`skip_unless_compiled`."""
    return pytest.mark.gpu(pytest.mark.parametrize("target", GPU_TARGETS, ids=lambda t: t.label)(test))


def skip_unless_compiled(target: Target) -> None:
    """Skip the calling GPU test without a CUDA device, or when the kernels run under the interpreter."""
    target.skip_unless_available()
    if INTERPRET:
        pytest.skip("TRITON_INTERPRET=1: the GPU tests need compiled kernels")


__all__ = ["GPU_TARGETS", "INTERPRET", "G", "N", "R", "S", "interp", "on_gpu_targets", "skip_unless_compiled"]

"""Shared fixtures: tiny diffusers checkpoints written by diffusers itself, and input builders.

Triton mode is set here, once for the whole session, before any test module is collected: without a
CUDA device ``TRITON_INTERPRET=1`` (Triton reads it when ``@triton.jit`` is applied, i.e. when a kernel
module is first imported), so every Triton kernel module is built for the interpreter exactly once and
test modules import it plainly — no reloads, no dependence on which module ran first. With a CUDA
device nothing here touches ``TRITON_INTERPRET``: the kernels compile for the GPU.

The interpreter runs ``tl.dot`` as ``numpy.matmul``, i.e. numpy's bundled OpenBLAS, whose kernel is chosen at
load time from the CPU. Some of those kernels (the AVX2 "Haswell" one, which OpenBLAS also picks on AMD Zen)
round a row's dot product differently depending on the row's position in the tile, so a sample's GEMM rows
would depend on its batch position in the interpreter while the GPU's tile arithmetic does not. The
SSE3 kernel ("Prescott", present in every x86-64 build) does not: it is pinned here, before numpy loads.
"""

from __future__ import annotations

import os
import sys

_blas_unpinned = "numpy" in sys.modules and os.environ.get("OPENBLAS_CORETYPE") != "Prescott"
os.environ["OPENBLAS_CORETYPE"] = "Prescott"  # row-position invariant matmul for the interpreter (see above)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

if not torch.cuda.is_available():
    _built_early = sorted(m for m in sys.modules if m.startswith("mmdit_strict.kernels.triton."))
    if _built_early and os.environ.get("TRITON_INTERPRET") != "1":
        raise pytest.UsageError(
            f"Triton kernel modules {_built_early} were imported before tests/conftest.py could switch "
            "TRITON_INTERPRET on (no CUDA device): they are built for a GPU this machine lacks"
        )
    if _blas_unpinned:
        raise pytest.UsageError("numpy was imported before tests/conftest.py could pin OPENBLAS_CORETYPE=Prescott "
                                "for the Triton interpreter's matmul: export OPENBLAS_CORETYPE=Prescott")
    os.environ["TRITON_INTERPRET"] = "1"

from tests.helpers import TINY_DIFFUSERS_KWARGS, make_diffusers_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """(path, diffusers model in FP32) of a randomly initialised tiny Qwen-Image transformer."""
    path = tmp_path_factory.mktemp("ckpt") / "transformer"
    model = make_diffusers_checkpoint(path, seed=0, **TINY_DIFFUSERS_KWARGS)
    return path, model


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)

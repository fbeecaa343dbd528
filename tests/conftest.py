"""Shared fixtures: tiny diffusers checkpoints written by diffusers itself, and input builders.

Triton mode is set here, once for the whole session, before any test module is collected: without a
CUDA device ``TRITON_INTERPRET=1`` (Triton reads it when ``@triton.jit`` is applied, i.e. when a kernel
module is first imported), so every Triton kernel module is built for the interpreter exactly once and
test modules import it plainly — no reloads, no dependence on which module ran first. With a CUDA
device nothing here touches ``TRITON_INTERPRET``: the kernels compile for the GPU.
"""

from __future__ import annotations

import os
import sys

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

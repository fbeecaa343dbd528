"""Shared fixtures: tiny diffusers checkpoints written by diffusers itself, and input builders."""

from __future__ import annotations

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

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

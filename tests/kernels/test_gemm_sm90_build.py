"""The GEMM main kernel's LoRA and gated-residual launches build for the H200 (sm_90) offline, no GPU needed.

The interpreter runs code the GPU compiler refuses (once: a configuration field used as a ``tl.zeros`` shape, which
Triton 3.6 refuses and 3.9 accepts), so the CPU suite also compiles the launches whose epilogue holds the most code:
the MLP up layer's forward with bias, the LoRA term, the stored pre-activation and tanh-GELU, in 1, 2 and 4 epilogue
parts. ``MMDIT_SM90_TRITON`` names an unpacked Triton wheel to build with (CI unpacks 3.6, the H200's version);
without it the installed Triton's NVIDIA backend builds them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def _triton_dir() -> Path:
    chosen = os.environ.get("MMDIT_SM90_TRITON")
    if chosen:
        return Path(chosen)
    return Path(triton.__file__).resolve().parents[1]


_DIR = _triton_dir()
_HAS_BACKEND = (_DIR / "triton" / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _HAS_BACKEND and not os.environ.get("MMDIT_SM90_TRITON"),
                    reason="the installed Triton has no NVIDIA backend with ptxas")
def test_lora_launches_build_for_sm90_in_every_epilogue_split() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, "-m", "benchmarks.lora_regs_sass", "--triton", str(_DIR), "--stream", "image",
            "--pass", "forward", "--layer", "3072x12288", "--lora-only", "--epi-split", "1", "2", "4"]
    run = subprocess.run(args, cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split("|") for line in run.stdout.splitlines() if line.startswith("| image: 3072 → 12288 GELU")]
    assert [r[4].strip() for r in rows] == ["1", "2", "4"], run.stdout  # the parts the kernel was built with
    assert all(0 < int(r[6]) <= 255 for r in rows), run.stdout  # registers per thread, read from the cubin


@pytest.mark.skipif(not _HAS_BACKEND and not os.environ.get("MMDIT_SM90_TRITON"),
                    reason="the installed Triton has no NVIDIA backend with ptxas")
def test_gated_residual_launches_build_for_sm90() -> None:
    """The GATE_RESIDUAL epilogue (per-row sample gather of the gate, residual read) builds in both streams' tiles,
    with and without the LoRA term."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, "-m", "benchmarks.lora_regs_sass", "--triton", str(_DIR), "--gate", "--layer", "3072x3072"]
    run = subprocess.run(args, cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split("|") for line in run.stdout.splitlines() if "+ gated residual" in line]
    assert [(r[1].split(":")[0].strip(), r[5].strip()) for r in rows] == [
        ("image", "no"), ("image", "yes"), ("text", "no"), ("text", "yes")], run.stdout
    assert all(0 < int(r[6]) <= 255 for r in rows), run.stdout

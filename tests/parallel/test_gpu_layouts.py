"""The layout checks on GPUs: NCCL across >= 2 GPUs, and host-staged gloo with ranks sharing one GPU.

Each runs ``python -m mmdit_strict.trajectories.layout_check`` under torchrun on the tiny architecture at a 16×16
latent grid (BF16) and requires every layout's velocity and LoRA gradient fold to equal one rank's bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.test_torchrun import ROOT, _env

pytestmark = pytest.mark.gpu


def _check(tmp_path: Path, ranks: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           "-m", "mmdit_strict.trajectories.layout_check", "--arch", "tiny", "--size", "256", "--layouts", "sp2,cfg2,sp2xcfg2,tp2,tp2xcfg2,sp2ag",
           "--out", str(tmp_path), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "parallel_check.json").read_text())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_ranks_sharing_one_gpu_keep_one_ranks_bytes(tmp_path: Path) -> None:
    report = _check(tmp_path, 4, [])
    assert report["pass"] and {r["layout"] for r in report["rows"]} == {"sp2", "cfg2", "sp2xcfg2", "tp2", "tp2xcfg2", "sp2ag"}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_nccl_layouts_keep_one_ranks_bytes(tmp_path: Path) -> None:
    report = _check(tmp_path, 2 * (torch.cuda.device_count() // 2), ["--backend", "nccl"])
    assert report["pass"]

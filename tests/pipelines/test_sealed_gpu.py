"""The GPU-sealed fixtures (issue 33): the text → image and the edit fixture run again with the model in BF16 on
the GPU (strict Triton kernels), sealed on the H200 in tests/fixtures/sealed_{t2i,edit}_gpu/. On their sealing
platform (GPU name, compute capability, torch, Triton and CUDA versions) a replay matches every per-step hash and
the final latents byte for byte. The files are checked against their sealed sha256 on every machine (CI too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmdit_strict.pipelines.sealed import fixture_device, platform_id, replay, verify_files

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GPU_FIXTURES = [FIXTURES / "sealed_t2i_gpu", FIXTURES / "sealed_edit_gpu"]


@pytest.mark.parametrize("folder", GPU_FIXTURES, ids=lambda p: p.name)
def test_the_gpu_fixture_records_its_gpu_platform_and_files(folder: Path) -> None:
    record = verify_files(folder)
    assert fixture_device(record) == "cuda"
    assert set(record["platform"]) == {"gpu", "capability", "torch", "triton", "cuda"}
    assert "model.dtype=bfloat16" in record["overrides"]
    assert all(len(s["x"]) == 2 for s in record["steps"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("folder", GPU_FIXTURES, ids=lambda p: p.name)
def test_the_gpu_fixture_replays_byte_for_byte_on_its_platform(folder: Path, tmp_path: Path) -> None:
    record = verify_files(folder)
    if record["platform"] != platform_id("cuda"):
        pytest.skip(f"sealed on {record['platform']}; GPU bytes are promised on that platform only")
    result = replay(folder, tmp_path / "replay")
    assert result.same_platform and result.steps_equal and result.latents_equal, result
    assert result.passed

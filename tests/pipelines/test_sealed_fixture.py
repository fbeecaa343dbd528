"""The sealed text → image fixture (issue 33): the tiny random pipeline, two prompts, 4 steps at 64², frozen in
tests/fixtures/sealed_t2i/ with the sha256 of every file and the platform it was sealed on. A replay must match
every per-step hash and the final latents byte for byte on that platform; elsewhere it is held to the declared
tolerance and says so."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from mmdit_strict.pipelines.sealed import FIXTURE, platform_id, replay, verify_files

SEALED = Path(__file__).resolve().parents[1] / "fixtures" / "sealed_t2i"


def test_the_sealed_fixture_replays(tmp_path: Path) -> None:
    result = replay(SEALED, tmp_path / "replay")
    assert result.passed, result
    if result.same_platform:
        assert result.steps_equal and result.latents_equal
        assert result.psnr_db and all(p == float("inf") for p in result.psnr_db)  # the same latents decode to the same PNGs
    else:
        warnings.warn(" ".join(result.notes))  # said, not hidden: only the tolerance holds off the sealing platform


def test_the_fixture_records_its_platform_and_every_file() -> None:
    record = verify_files(SEALED)
    assert set(record["platform"]) == set(platform_id())
    assert {"expected.safetensors", "pipeline/transformer/diffusion_pytorch_model.safetensors",
            "pipeline/vae/diffusion_pytorch_model.safetensors"} <= set(record["files"])
    assert len(record["steps"]) == 4 and all(len(s["x"]) == 2 for s in record["steps"])


def test_a_damaged_fixture_is_refused(tmp_path: Path) -> None:
    copy = tmp_path / "sealed"
    shutil.copytree(SEALED, copy)
    weights = copy / "pipeline" / "transformer" / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="transformer/diffusion_pytorch_model.safetensors does not match its sealed sha256"):
        verify_files(copy)
    data[-1] ^= 1
    weights.write_bytes(bytes(data))  # repaired
    verify_files(copy)
    (copy / "sample_0.png").unlink()
    record = json.loads((copy / FIXTURE).read_text())
    assert "sample_0.png" in record["files"]
    with pytest.raises(ValueError, match="sample_0.png is missing"):
        verify_files(copy)

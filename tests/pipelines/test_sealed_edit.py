"""The sealed edit fixture (issue 33): the tiny random pipeline, two instructions each with its own input picture
(64×64 and 48×80, VAE-encoded by the fixture's VAE), 3 steps at 64², frozen in tests/fixtures/sealed_edit/ with
the sha256 of every file (pictures included), the conditioning latents' hashes and the sealing platform. On that
platform a replay matches every per-step hash, the conditioning and the final latents byte for byte; elsewhere
it is held to tolerances.yaml's pipelines.sealed_latents_other_platform and says so."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest

from mmdit_strict.pipelines.sealed import replay, verify_files

SEALED = Path(__file__).resolve().parents[1] / "fixtures" / "sealed_edit"


@pytest.mark.slow
def test_the_sealed_edit_fixture_replays(tmp_path: Path) -> None:
    result = replay(SEALED, tmp_path / "replay")
    assert result.passed, result
    if result.same_platform:
        assert result.steps_equal and result.latents_equal
        assert result.psnr_db and all(p == float("inf") for p in result.psnr_db)
    else:
        warnings.warn(" ".join(result.notes))


def test_the_edit_fixture_records_its_inputs() -> None:
    record = verify_files(SEALED)
    assert {"input/input_0.png", "input/input_1.png", "expected.safetensors",
            "pipeline/vae/diffusion_pytorch_model.safetensors"} <= set(record["files"])
    assert record["conditioning"]["grids"] == [[4, 4], [3, 5]]  # the two pictures' sizes / 16: mixed in one batch
    assert len(record["steps"]) == 3 and all(len(s["x"]) == 2 for s in record["steps"])


def test_a_changed_input_picture_is_refused(tmp_path: Path) -> None:
    copy = tmp_path / "sealed"
    shutil.copytree(SEALED, copy)
    pic = copy / "input" / "input_1.png"
    pic.write_bytes(pic.read_bytes()[:-1] + b"\0")
    with pytest.raises(ValueError, match="input/input_1.png does not match its sealed sha256"):
        verify_files(copy)

"""Exit codes: 0 byte-identical, 1 drift, 2 bad input or any error (one line; traceback only with -v)."""

from __future__ import annotations

from pathlib import Path

import pytest

import mmdit_strict.trajectories.pipeline as pipeline
from mmdit_strict.cli.main import EXIT_DRIFT, EXIT_ERROR, EXIT_OK, build_parser, main

SMALL = ["sampler.num_steps=2", "prompts.num_prompts=2", "wandb.mode=disabled", "progress=false"]


def test_codes_are_documented_in_help() -> None:
    text = build_parser().format_help()
    assert (EXIT_OK, EXIT_DRIFT, EXIT_ERROR) == (0, 1, 2)
    for line in ("0  byte-identical", "1  drift", "2  bad input or any error"):
        assert line in text
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "| 2 |" in readme and "| 1 |" in readme


def test_unexpected_exception_is_code_2_with_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    def boom(cfg, progress=True):
        raise RuntimeError("CUDA out of memory.\nTried to allocate 2.00 GiB")

    monkeypatch.setattr(pipeline, "run_all", boom)
    assert main(["run", "--quiet", f"output_dir={tmp_path / 'x'}", *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "RuntimeError" in err and "out of memory" in err
    assert main(["-v", "run", "--quiet", f"output_dir={tmp_path / 'x'}", *SMALL]) == 2
    assert "Traceback" in capsys.readouterr().err
    assert main(["run", "-v", "--quiet", f"output_dir={tmp_path / 'x'}", *SMALL]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_memory_error_is_code_2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    def oom(cfg, progress=True):
        raise MemoryError()

    monkeypatch.setattr(pipeline, "run_all", oom)
    assert main(["run", "--quiet", f"output_dir={tmp_path / 'x'}", *SMALL]) == 2
    assert "MemoryError" in capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    ("sampler.height=-16", "sampler.height"),
    ("sampler.num_steps=100000", "sampler.num_steps"),
    ("recompute.micro_batch=0", "recompute.micro_batch"),
])
def test_bad_input_is_code_2(override: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["run", "--quiet", f"output_dir={tmp_path / 'x'}", *SMALL, override]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists(), "nothing is written before the config is valid"


def test_malformed_manifest_is_code_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "manifest.json").write_text("{not json")
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "a")]) == 2
    assert "invalid JSON" in capsys.readouterr().err

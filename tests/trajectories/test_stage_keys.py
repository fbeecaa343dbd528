"""Stage reuse and resume are keyed by content, not paths: weights, LoRA, prompt embeddings, package version."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import mmdit_strict
import mmdit_strict.trajectories.rollout as rollout_mod
import mmdit_strict.trajectories.setup as setup_mod
from mmdit_strict.cli.main import main
from mmdit_strict.config.arch import preset
from mmdit_strict.config.compose import compose
from mmdit_strict.model import build_model
from mmdit_strict.trajectories import read, run_rollout
from mmdit_strict.trajectories.pipeline import run_all

SMALL = ["sampler.num_steps=2", "prompts.num_prompts=2", "wandb.mode=disabled", "progress=false"]


def _run(out: Path, *overrides: str):
    return run_all(compose([f"output_dir={out}", *SMALL, *overrides]), progress=False)


def _save_checkpoint(path: Path, seed: int) -> None:
    build_model(preset("tiny"), seed=seed).save_pretrained(path)


def _weights(out: Path, stage: str) -> str:
    return json.loads((out / stage / "manifest.json").read_text())["weights_sha256"]


def test_retrained_checkpoint_reruns_both_stages_and_says_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    _save_checkpoint(ckpt, seed=0)
    _run(out, f"model.checkpoint={ckpt}")
    old = _weights(out, "rollout")
    _save_checkpoint(ckpt, seed=1)  # "retrain" into the same folder
    with caplog.at_level(logging.WARNING):
        result = _run(out, f"model.checkpoint={ckpt}")
    assert result.byte_identical
    new = _weights(out, "rollout")
    assert new != old, "the rollout of the old weights was reused"
    assert _weights(out, "recompute") == new
    assert "re-running rollout" in caplog.text and "weights_sha256" in caplog.text


def test_checkpoint_overwritten_between_kill_and_resume_is_not_spliced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = tmp_path / "ckpt"
    _save_checkpoint(ckpt, seed=0)
    cfg = compose([f"output_dir={tmp_path}", *SMALL, "sampler.num_steps=3", f"model.checkpoint={ckpt}"])
    real = rollout_mod.step_latents

    def killed_at_2(sampler, seed, v, x, sigmas, step, ids, prev_sample=None):
        if step == 2:
            raise KeyboardInterrupt
        return real(sampler, seed, v, x, sigmas, step, ids, prev_sample=prev_sample)

    monkeypatch.setattr(rollout_mod, "step_latents", killed_at_2)
    with pytest.raises(KeyboardInterrupt):
        run_rollout(cfg, tmp_path / "r", progress=False)
    monkeypatch.undo()
    _save_checkpoint(ckpt, seed=1)
    resumed = run_rollout(cfg, tmp_path / "r", progress=False)
    assert resumed.manifest["side"]["resumed_after_step"] is None
    whole = run_rollout(cfg, tmp_path / "whole", progress=False)
    assert [s["x"] for s in resumed.manifest["steps"]] == [s["x"] for s in whole.manifest["steps"]]


def _write_embeddings(path: Path, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    save_file({"prompt_embeds": torch.randn(2, 4, 48, generator=g), "prompt_mask": mask,
               "negative_embeds": torch.randn(3, 48, generator=g)}, str(path))


def test_reexported_prompt_embeddings_rerun_the_rollout(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    emb, out = tmp_path / "emb.safetensors", tmp_path / "run"
    _write_embeddings(emb, 0)
    _run(out, f"prompts.embeddings={emb}")
    old = read(out / "rollout").manifest["prompt_hashes"]
    _write_embeddings(emb, 1)
    with caplog.at_level(logging.WARNING):
        assert _run(out, f"prompts.embeddings={emb}").byte_identical
    assert read(out / "rollout").manifest["prompt_hashes"] != old
    assert read(out / "recompute").manifest["prompt_hashes"] == read(out / "rollout").manifest["prompt_hashes"]
    assert "prompts_sha256" in caplog.text


def test_new_package_version_reruns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "run"
    _run(out)
    monkeypatch.setattr(mmdit_strict, "__version__", "99.0.0")
    with caplog.at_level(logging.WARNING):
        _run(out)
    for stage in ("rollout", "recompute"):
        assert read(out / stage).manifest["software"]["mmdit_strict"] == "99.0.0"
    assert "mmdit_strict" in caplog.text


def test_other_lora_weights_rerun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    _run(out)
    old = read(out / "rollout").manifest["lora_sha256"]
    real = setup_mod.attach_lora

    def retrained(model, lcfg):
        real(model, lcfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.add_(0.01)
        return model

    monkeypatch.setattr(setup_mod, "attach_lora", retrained)
    assert _run(out).byte_identical
    assert read(out / "rollout").manifest["lora_sha256"] != old
    assert read(out / "recompute").manifest["lora_sha256"] == read(out / "rollout").manifest["lora_sha256"]


def test_report_reads_config_from_manifests(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    fault = "recompute.inject_fault=block1.img.mlp_down_gemm@1"
    assert main(["run", "--quiet", f"output_dir={out}", *SMALL, fault]) == 1
    first = json.loads((out / "report" / "report.json").read_text())["localization"]["first"]
    capsys.readouterr()
    # a later run with an override that fails after composing rewrites config.yaml; the report must not care
    assert main(["run", "--quiet", f"output_dir={out}", *SMALL, f"model.checkpoint={tmp_path / 'nowhere'}"]) == 2
    assert main(["report", str(out)]) == 1
    assert json.loads((out / "report" / "report.json").read_text())["localization"]["first"] == first


def test_report_refuses_weights_that_changed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    _save_checkpoint(ckpt, seed=0)
    assert main(["run", "--quiet", f"output_dir={out}", *SMALL, f"model.checkpoint={ckpt}", "recompute.runtime=off"]) == 1
    _save_checkpoint(ckpt, seed=1)
    capsys.readouterr()
    assert main(["report", str(out)]) == 2
    assert "weights" in capsys.readouterr().err


def test_stale_block_plot_is_removed_on_a_clean_rerun(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert not _run(out, "recompute.inject_fault=block1.img.mlp_down_gemm@1").byte_identical
    assert (out / "report" / "drift_per_block.png").exists()
    assert _run(out).byte_identical
    assert not (out / "report" / "drift_per_block.png").exists()
    assert "drift_per_block" not in (out / "report" / "report.md").read_text()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_identical_runs_write_identical_tensor_files(tmp_path: Path) -> None:
    _run(tmp_path / "a")
    _run(tmp_path / "b")
    for stage in ("rollout", "recompute"):
        assert _sha(tmp_path / "a" / stage / "tensors.safetensors") == _sha(tmp_path / "b" / stage / "tensors.safetensors")
    # the same artifact written again is the same bytes, header in sorted order with fixed metadata
    traj = read(tmp_path / "a" / "rollout")
    from mmdit_strict.trajectories import write

    digests = set()
    for i in range(6):
        write(traj, tmp_path / f"w{i}")
        digests.add(_sha(tmp_path / f"w{i}" / "tensors.safetensors"))
    assert len(digests) == 1
    raw = (tmp_path / "w0" / "tensors.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n], object_pairs_hook=list)
    names = [k for k, _ in header]
    assert names == sorted(names)
    meta = dict(header)["__metadata__"]
    assert [k for k, _ in meta] == sorted(k for k, _ in meta)


@pytest.mark.parametrize("fault, message", [
    ("block1.img.mlp_dwn_gemm@1", "mlp_dwn_gemm"),
    ("block1.imgg.mlp_down_gemm@1", "block1.imgg.mlp_down_gemm"),
])
def test_fault_naming_no_operator_is_refused_before_any_work(tmp_path: Path, fault: str, message: str,
                                                             capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    assert main(["run", "--quiet", f"output_dir={out}", *SMALL, f"recompute.inject_fault={fault}"]) == 2
    err = capsys.readouterr().err
    assert message in err and "inject_fault" in err
    assert not (out / "rollout").exists() and not (out / "rollout.partial").exists()


def test_pad_to_shorter_than_an_embedded_prompt_is_refused_before_the_rollout(tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture) -> None:
    emb, out = tmp_path / "emb.safetensors", tmp_path / "run"
    _write_embeddings(emb, 0)  # prompts of 3 and 4 tokens, negative of 3
    assert main(["run", "--quiet", f"output_dir={out}", *SMALL, f"prompts.embeddings={emb}", "recompute.pad_to=3"]) == 2
    assert "recompute.pad_to=3 is shorter than the longest prompt (4 tokens)" in capsys.readouterr().err
    assert not (out / "rollout").exists() and not (out / "rollout.partial").exists()


@pytest.mark.parametrize("override, recompute_reruns", [
    ("recompute.micro_batch=2", True),
    ("compare.localize=false", False),
    ("+extra.note=x", False),
])
def test_a_key_the_rollout_does_not_read_keeps_a_finished_rollout(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                  override: str, recompute_reruns: bool) -> None:
    out = tmp_path / "run"
    _run(out)
    before = {stage: (out / stage / "manifest.json").read_bytes() for stage in ("rollout", "recompute")}
    with caplog.at_level(logging.WARNING):
        assert _run(out, override).byte_identical
    assert "re-running rollout" not in caplog.text
    assert (out / "rollout" / "manifest.json").read_bytes() == before["rollout"]
    if recompute_reruns:
        key = override.split("=")[0]
        assert "re-running recompute" in caplog.text and f"{key} 3 → 2" in caplog.text
    else:
        assert "re-running" not in caplog.text
        assert (out / "recompute" / "manifest.json").read_bytes() == before["recompute"]


def test_a_sampler_key_reruns_the_rollout_and_names_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "run"
    _run(out)
    with caplog.at_level(logging.WARNING):
        assert _run(out, "sampler.eta=0.5").byte_identical
    rerun = [r.getMessage() for r in caplog.records if r.getMessage().startswith("re-running rollout")]
    assert len(rerun) == 1 and "sampler.eta 0.7 → 0.5" in rerun[0], caplog.text
    assert "recompute.micro_batch" not in rerun[0] and "weights_sha256" not in rerun[0]
    assert read(out / "rollout").manifest["stage_key"]["config"]["sampler.eta"] == 0.5


def test_a_side_runtime_is_keyed_as_resolved(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``runtime.mode`` matters to a side only through its resolved runtime: naming it on the side keeps the rollout."""
    out = tmp_path / "run"
    _run(out)
    with caplog.at_level(logging.WARNING):
        assert _run(out, "rollout.runtime=strict", "recompute.runtime=strict").byte_identical
    assert "re-running" not in caplog.text
    with caplog.at_level(logging.WARNING):
        _run(out, "runtime=off", "rollout.runtime=strict")
    assert "re-running rollout" not in caplog.text
    assert "re-running recompute" in caplog.text and "recompute.runtime 'strict' → 'off'" in caplog.text

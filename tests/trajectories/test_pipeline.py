"""The main job end to end on the tiny default (issue 4's "Done when")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmdit_strict.cli.main import main
from mmdit_strict.config.compose import compose
from mmdit_strict.trajectories.pipeline import run_all

SMALL = ["sampler.num_steps=3", "prompts.num_prompts=3", "wandb.mode=disabled", "progress=false"]


def _run(tmp_path: Path, *overrides: str):
    cfg = compose([f"output_dir={tmp_path}", *SMALL, *overrides])
    return run_all(cfg, progress=False)


def test_strict_run_is_byte_identical(tmp_path: Path) -> None:
    result = _run(tmp_path / "strict")
    assert result.byte_identical, result.summary
    assert result.comparison.differing == {"v": 0, "x": 0, "logp": 0}
    assert result.comparison.logp_ratio["min"] == 1.0 and result.comparison.logp_ratio["max"] == 1.0
    report = json.loads((tmp_path / "strict" / "report" / "report.json").read_text())
    assert report["byte_identical"] is True
    assert (tmp_path / "strict" / "report" / "report.md").read_text().startswith("# mmdit-strict")
    assert (tmp_path / "strict" / "report" / "drift_per_step.png").stat().st_size > 1000
    assert (tmp_path / "strict" / "config.yaml").exists()
    # the report says where it ran: this machine's torch, and no GPU for a CPU run
    import torch

    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["gpu"] is None and env["commit"]
    assert f"torch {torch.__version__}" in (tmp_path / "strict" / "report" / "report.md").read_text()
    # both sides ran only strict kernels, with no fallback
    for side in report["sides"].values():
        # (the model's operators on cpu_strict, the sampling chain's on torch_fixed)
        assert side["trace"]["backends"] == ["cpu_strict", "torch_fixed"] and side["trace"]["fallbacks"] == []


def test_recompute_off_drifts_at_first_operator(tmp_path: Path) -> None:
    result = _run(tmp_path / "off", "recompute.runtime=off")
    assert not result.byte_identical
    first = result.comparison.first
    assert (first.step, first.quantity) == (0, "v")
    loc = result.localization
    assert loc is not None and loc.first is not None
    # the first operator the production path runs differently is the timestep MLP (plain F.linear)
    assert loc.first.operator == "timestep_embed_mlp" and loc.first.block is None
    assert loc.first.max_ulp > 0 and loc.first.max_abs > 0


def test_injected_fault_is_localized(tmp_path: Path) -> None:
    result = _run(tmp_path / "fault", "recompute.inject_fault=block1.img.mlp_down_gemm@1")
    first = result.comparison.first
    assert first is not None and first.step == 1 and first.quantity == "v"
    o = result.localization.first
    assert (o.operator, o.block, o.stream, o.branch, o.logical_row, o.element) == ("mlp_down_gemm", 1, "img", "cond", 0, 0)
    assert o.rows_differing == 1
    # steps before the fault stay byte-identical
    assert result.comparison.curves["v_max_abs"][0] == 0.0


@pytest.mark.slow
def test_fault_on_the_off_path_is_localized_by_replaying_the_production_forward(tmp_path: Path) -> None:
    """Both sides off with the same batch layout: byte-identical except a planted fault, which the localizer
    finds by replaying each side's production forward (padded captures, unpadded per sample)."""
    same_layout = ["runtime=off", "rollout.batch_size=3", "recompute.micro_batch=3", "recompute.shuffle=false",
                   "recompute.cfg_layout=batched"]
    result = _run(tmp_path / "off_fault", *same_layout, "recompute.inject_fault=block1.txt.k.qk_rmsnorm@1")
    first = result.comparison.first
    assert first is not None and first.step == 1, "steps before the fault stay byte-identical on the off path"
    o = result.localization.first
    assert (o.operator, o.block, o.stream, o.branch, o.logical_row, o.element) == ("qk_rmsnorm", 1, "txt", "cond", 0, 0)
    assert o.key == "block1.txt.k.qk_rmsnorm" and o.rows_differing == 1
    assert any("replayed with the production forward it ran" in n for n in result.localization.notes)


def test_resume_reuses_verified_stages(tmp_path: Path) -> None:
    out = tmp_path / "resume"
    _run(out)
    stamp = (out / "rollout" / "manifest.json").stat().st_mtime_ns
    again = _run(out)
    assert again.byte_identical
    assert (out / "rollout" / "manifest.json").stat().st_mtime_ns == stamp
    # a corrupted stage is re-run rather than trusted
    data = bytearray((out / "recompute" / "tensors.safetensors").read_bytes())
    data[-5] ^= 0xFF
    (out / "recompute" / "tensors.safetensors").write_bytes(bytes(data))
    assert _run(out).byte_identical


def test_cli_run_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["run", "--quiet", f"output_dir={tmp_path / 'cli'}", *SMALL]) == 0
    assert "byte-identical" in capsys.readouterr().out
    assert main(["run", "--quiet", f"output_dir={tmp_path / 'cli_off'}", *SMALL, "recompute.runtime=off"]) == 1
    assert "DRIFT: first at step 0" in capsys.readouterr().out
    assert main(["compare", str(tmp_path / "cli" / "rollout"), str(tmp_path / "cli" / "recompute")]) == 0
    assert main(["report", str(tmp_path / "cli_off")]) == 1


def test_audit_mode_records_block_hashes_and_production_drift(tmp_path: Path) -> None:
    result = _run(tmp_path / "audit", "runtime=audit", "recompute.inject_fault=block1.img.mlp_down_gemm@0")
    first = result.comparison.first
    assert first is not None and first.step == 0
    assert first.block == 1  # read from the per-block hashes, before any re-run
    assert result.localization.first.block == 1
    audit = result.report["sides"]["rollout"]["audit"]
    assert audit["forwards"] > 0 and len(audit["per_block_max_abs"]) == 2
    assert audit["max_abs_drift"] < 1e-4  # production stays close to strict on the tiny model
    assert (tmp_path / "audit" / "report" / "audit_per_block.png").stat().st_size > 1000


def test_wandb_offline_logging(tmp_path: Path) -> None:
    pytest.importorskip("wandb")  # a declared dependency; absent only on machines without a package index
    out = tmp_path / "wb"
    assert main(["run", "--quiet", f"output_dir={out}", "sampler.num_steps=2", "prompts.num_prompts=2", "wandb.mode=offline"]) == 0
    runs = list((out / "wandb").glob("offline-run-*"))
    assert runs and any(p.suffix == ".wandb" for p in runs[0].iterdir())


def test_sample_command_writes_latents_and_hashes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sample"
    assert main(["sample", "--quiet", f"output_dir={out}", "sampler.num_steps=2", "prompts.num_prompts=2"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("step ") == 2 and "latents and hashes" in printed
    from mmdit_strict.trajectories import read

    traj = read(out / "rollout")
    assert traj.tensors["x"].shape == (3, 2, 64, 64) and len(traj.manifest["steps"][1]["x"]) == 2


def test_stage_with_a_broken_manifest_is_rerun(tmp_path: Path) -> None:
    out = tmp_path / "broken"
    _run(out)
    m = json.loads((out / "rollout" / "manifest.json").read_text())
    del m["config"]
    (out / "rollout" / "manifest.json").write_text(json.dumps(m))
    assert _run(out).byte_identical
    assert "config" in json.loads((out / "rollout" / "manifest.json").read_text())


def test_peer_loop_times_diffusers_on_the_same_sampling(tmp_path: Path) -> None:
    """compare.peer_loop runs diffusers' transformer over the same batches, noise and schedule; the report
    gives both wall times and the peer's final latents match ours within the declared tolerance."""
    import torch

    from mmdit_strict.tolerances import tolerance
    from mmdit_strict.trajectories import artifact
    from mmdit_strict.trajectories.peer import peer_rollout
    from mmdit_strict.trajectories.setup import build_side_model, make_prompts, side_runtime

    result = _run(tmp_path / "peer", "compare.peer_loop=true")
    assert result.byte_identical
    peer = result.report["peer"]
    assert peer["wall_seconds"] > 0 and peer["warmup_seconds"] > 0 and len(peer["step_seconds"]) == 3
    assert peer["rollout_vs_peer"] == pytest.approx(peer["rollout_wall_seconds"] / peer["wall_seconds"])
    assert set(result.report["phases"]) == {"build", "hash_weights", "compile", "rollout", "peer_rollout",
                                             "recompute", "compare"}
    assert "× the peer" in (tmp_path / "peer" / "report" / "report.md").read_text()

    cfg = compose([f"output_dir={tmp_path / 'peer'}", *SMALL])
    model = build_side_model(cfg.model, cfg.lora, side_runtime(cfg, "rollout"))
    x_peer = peer_rollout(cfg, model, make_prompts(cfg.prompts, model.config, "cpu", cfg.model.dtype), progress=False)["x_final"]
    ours = artifact.read(tmp_path / "peer" / "rollout").tensors["x"][-1]
    ok, worst, _ = tolerance("trajectories", "peer_final_latents_vs_ours", torch.float32).check(x_peer, ours)
    assert ok, f"peer final latents differ from ours by {worst:.3e}"
    assert not torch.equal(x_peer, ours)  # a different engine: close, not the same bytes


def test_missing_wandb_fails_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb.mode=offline without the package is refused at once, naming the fix; nothing is written."""
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    out = tmp_path / "nowb"
    assert main(["run", "--quiet", f"output_dir={out}", *SMALL[:2], "wandb.mode=offline"]) == 2
    assert not (out / "rollout").exists()
    assert main(["run", "--quiet", f"output_dir={out}", *SMALL[:2], "wandb.mode=disabled"]) == 0

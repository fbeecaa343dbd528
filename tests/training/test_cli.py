"""`mmdit-strict train`: exit codes, outputs beside the run (wandb offline folder, metrics, curve, LoRA folders)."""

from __future__ import annotations

import json
import re

import pytest

from mmdit_strict.cli.main import main

QUICK = ["sampler.num_steps=2", "sample.prompts_per_epoch=1", "sample.num_image_per_prompt=2", "train.num_epochs=1",
         "train.eval_freq=1", "train.eval_num_prompts=1", "--quiet"]


@pytest.mark.slow
def test_train_command_writes_the_run(tmp_path, capsys) -> None:
    pytest.importorskip("wandb")  # a declared dependency; absent only on machines without a package index
    out = tmp_path / "run"
    assert main(["train", "experiment=grpo_tiny", f"output_dir={out}", "wandb.mode=offline", *QUICK]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"first-update logp byte-equal to the rollout's: (\d+)/\1 pairs \(max \|ratio-1\| 0\)", printed), printed
    assert re.search(r"last epoch: rollout [\d.]+ s, .*train [\d.]+ s, .*peak (resident set|GPU memory)", printed), printed
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["first_update_ratio_exact_one_frac"] == 1.0 and "eval_reward_mean" in rows[0]
    for key in ("reward_mean", "reward_std", "zero_std_ratio", "adv_mean", "adv_std", "ratio_min", "ratio_max",
                "ratio_exact_one_frac", "clipfrac", "approx_kl", "policy_loss", "kl_loss", "grad_norm", "lr",
                "time_rollout_s", "time_reward_s", "time_train_s", "time_optimizer_s", "peak_memory_mb"):
        assert key in rows[0], key
    assert (out / "reward_curve.png").stat().st_size > 0
    assert (out / "epoch_costs.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "lora" / "peft" / "adapter_config.json").exists()
    assert (out / "lora" / "diffusers" / "pytorch_lora_weights.safetensors").exists()
    assert any((out / "wandb").glob("offline-run-*"))
    assert (out / "checkpoints" / "latest").read_text().strip() == "epoch_000000"
    # a second call resumes: nothing left to do, same metrics
    assert main(["train", "experiment=grpo_tiny", f"output_dir={out}", "wandb.mode=disabled", *QUICK]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_train_exit_codes(tmp_path, capsys) -> None:
    base = ["train", "experiment=grpo_tiny", "wandb.mode=disabled", *QUICK, "train.export=false"]
    assert main([*base, f"output_dir={tmp_path / 'a'}", "train.micro_batch=0"]) == 2
    assert "train.micro_batch must be >= 1" in capsys.readouterr().err
    # the debug recompute of the old logp on the production path: drift → exit 1, and the message says where
    assert main([*base, f"output_dir={tmp_path / 'b'}", "train.runtime=off", "train.recompute_old_logp=true",
                 "lora.init=random", "sampler.num_steps=4", "sample.num_image_per_prompt=4", "train.timestep_fraction=1.0"]) == 1
    assert "recomputed logp" in capsys.readouterr().err

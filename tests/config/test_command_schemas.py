"""Each command composes only the keys it reads; foreign keys are refused with the valid ones, and every
value (train's too) is checked at compose time, before any folder exists."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from mmdit_strict.cli.main import main
from mmdit_strict.config.compose import ConfigError, compose, derive
from mmdit_strict.config.schema import SCHEMAS, AblateConfig, TrainRunConfig, TrajectoryConfig, section_names
from mmdit_strict.training.loop import RESUME_FREE, resume_differences
from mmdit_strict.training.rewards import compose_train

TRAJECTORY_KEYS = ["seed", "output_dir", "resume", "progress", "model", "runtime", "sampler", "prompts", "rollout",
                   "recompute", "lora", "compare", "wandb", "distributed", "extra"]
TRAIN_KEYS = ["seed", "output_dir", "resume", "progress", "model", "runtime", "sampler", "prompts", "lora", "sample",
              "train", "wandb", "distributed", "extra"]


def test_schema_per_command() -> None:
    assert section_names(TrajectoryConfig) == TRAJECTORY_KEYS
    assert section_names(TrainRunConfig) == TRAIN_KEYS
    assert {c for c, s in SCHEMAS.items() if s is TrajectoryConfig} == {"run", "rollout", "sample", "recompute"}
    assert SCHEMAS["train"] is TrainRunConfig
    assert set(compose([]).keys()) - {"_choices_"} == set(TRAJECTORY_KEYS)
    assert set(compose(["experiment=grpo_tiny"], command="train").keys()) - {"_choices_"} == set(TRAIN_KEYS)


@pytest.mark.parametrize("argv, named, valid_for", [
    (["run", "train.learning_rate=1"], "train.learning_rate", "run"),
    (["run", "sample.batch_size=2"], "sample.batch_size", "run"),
    (["rollout", "+train.extra_knob=1"], "train.extra_knob", "rollout"),
    (["train", "experiment=grpo_tiny", "recompute.micro_batch=2"], "recompute.micro_batch", "train"),
    (["train", "experiment=grpo_tiny", "compare.localize=false"], "compare.localize", "train"),
    (["train", "experiment=grpo_tiny", "rollout.batch_size=2"], "rollout.batch_size", "train"),
])
def test_a_key_the_command_does_not_read_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                     argv: list[str], named: str, valid_for: str) -> None:
    out = tmp_path / "out"
    assert main([*argv, f"output_dir={out}", "wandb.mode=disabled", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert named in err and "does not read" in err
    valid = TRAIN_KEYS if valid_for == "train" else TRAJECTORY_KEYS
    assert f"valid keys for {valid_for}: {', '.join(valid)}" in err
    assert not out.exists()


def test_ablate_schema_and_the_run_configs_derived_from_it() -> None:
    """ablate reads the trajectory sections (no wandb, no distributed) and its ablation; each job's run config
    is derived from it with key=value overrides and checked as a composed one."""
    assert SCHEMAS["ablate"] is AblateConfig
    cfg = compose(["experiment=ablation_tiny"], command="ablate")
    assert {"ablation", "rollout", "recompute"} <= set(cfg) and "wandb" not in cfg and "distributed" not in cfg
    job = derive(cfg, ["recompute.micro_batch=1", "output_dir=elsewhere", "wandb.mode=disabled"])
    assert set(job.keys()) - {"_choices_"} == set(TRAJECTORY_KEYS)
    assert (job.recompute.micro_batch, job.output_dir, job.wandb.mode) == (1, "elsewhere", "disabled")
    assert job.sampler.num_steps == cfg.sampler.num_steps and job._choices_.experiment == "ablation_tiny"
    with pytest.raises(ConfigError, match="runtime is a config section"):
        derive(cfg, ["runtime=off"])
    with pytest.raises(ConfigError, match="which `mmdit-strict run` does not read"):
        derive(cfg, ["ablation.probes=all"])
    with pytest.raises(ConfigError, match="recompute.micro_batch must be >= 1, got 0"):
        derive(cfg, ["recompute.micro_batch=0"])


def test_an_experiment_for_train_is_refused_by_run(capsys: pytest.CaptureFixture) -> None:
    assert main(["run", "experiment=grpo_tiny", "wandb.mode=disabled"]) == 2
    err = capsys.readouterr().err
    assert "experiment=grpo_tiny sets 'sample', 'train'" in err and "read by train" in err
    with pytest.raises(ConfigError, match="experiment=recompute_off sets 'recompute'"):
        compose(["experiment=recompute_off"], command="train")
    with pytest.raises(ConfigError, match="config group train=tiny sets 'train'"):
        compose(["train=tiny"])
    # experiments that set only shared keys work for both schemas
    assert compose(["experiment=no_lora"]).lora.rank == 0


def test_config_prints_the_schema_of_the_named_command(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "sampler.num_steps=3"]) == 0
    run_cfg = yaml.safe_load(capsys.readouterr().out)
    assert "recompute" in run_cfg and "train" not in run_cfg and "sample" not in run_cfg
    assert main(["config", "--for", "train", "experiment=grpo_tiny", "train.learning_rate=0.01"]) == 0
    train_cfg = yaml.safe_load(capsys.readouterr().out)
    assert train_cfg["train"]["learning_rate"] == 0.01 and "recompute" not in train_cfg and "compare" not in train_cfg
    assert main(["config", "--for", "train", "recompute.micro_batch=2"]) == 2
    assert "valid keys for train" in capsys.readouterr().err


def test_train_value_is_refused_at_compose_before_any_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    assert main(["train", "experiment=grpo_tiny", f"output_dir={out}", "wandb.mode=disabled", "train.micro_batch=0"]) == 2
    assert "train.micro_batch must be >= 1, got 0" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("overrides, message", [
    (["lora.rank=0"], "train needs a LoRA adapter"),
    (["train.num_epochs=0"], "train.num_epochs must be >= 1"),
    (["train.gradient_accumulation_steps=0"], "train.gradient_accumulation_steps must be >= 1"),
    (["train.save_freq=0"], "train.save_freq must be >= 1"),
    (["sample.num_image_per_prompt=0"], "sample.num_image_per_prompt must be >= 1"),
    (["sample.batch_size=0"], "sample.batch_size must be >= 1"),
    (["train.eval_freq=-1"], "train.eval_freq must be >= 0"),
    (["train.lr_warmup_steps=-2"], "train.lr_warmup_steps must be >= 0"),
    (["train.beta=-0.1"], "train.beta must be a finite number >= 0"),
    (["train.max_grad_norm=-1"], "train.max_grad_norm must be a finite number >= 0"),
    (["train.learning_rate=0"], "train.learning_rate must be a finite number > 0"),
    (["sample.noise_level=0"], "sample.noise_level must be a finite number > 0"),
    (["train.ema_decay=1.0"], r"train.ema_decay must be in \[0, 1\)"),
    (["train.adam_beta2=1.5"], r"train.adam_beta2 must be in \[0, 1\)"),
    (["train.timestep_fraction=0"], r"train.timestep_fraction must be in \(0, 1\]"),
    (["train.cpu_threads=0"], "train.cpu_threads must be null or >= 1"),
    (["train.park_lookahead=-1"], "train.park_lookahead must be null or >= 0 keys"),
    (["sampler.sde=false"], "sampler.sde must be true for train"),
    (["sample.sde_window_size=2", "sample.sde_window_range=[5, 6]"], "sample.sde_window_range must be"),
    (["+train.reward_fn.no_such_reward=1.0"], "unknown reward 'no_such_reward'"),
    (["train.reward_fn.latent_stats=0"], "names no reward with a non-zero weight"),
    (["+train.reward_kwargs.jpeg_compressibility={quality: 80}"], "reward_kwargs names rewards not in train.reward_fn"),
])
def test_train_values_are_checked_at_compose(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        compose_train(["experiment=grpo_tiny", *overrides])


def test_resume_free_keys_are_train_schema_keys() -> None:
    """Every key that may change across a train resume names a field of the train schema."""
    for key in RESUME_FREE:
        if key == "_choices_":
            continue
        node: typing.Any = TrainRunConfig
        for part in key.split("."):
            assert dataclasses.is_dataclass(node), f"RESUME_FREE key {key!r} goes below a leaf"
            hints = typing.get_type_hints(node)
            assert part in hints, f"RESUME_FREE key {key!r} is not in the train schema"
            node = hints[part]


def test_resume_compares_train_schema_keys_only() -> None:
    """A checkpoint keyed under a wider schema (trajectory sections too) still resumes; a train key that differs does not."""
    now = {"train.learning_rate": 0.05, "sample.batch_size": 4}
    wider = {**now, "recompute.micro_batch": 3, "compare.localize": True}
    assert resume_differences(now, wider) == []
    assert resume_differences(now, {**wider, "train.learning_rate": 0.01}) == ["train.learning_rate"]
    assert resume_differences(now, {"sample.batch_size": 4}) == ["train.learning_rate"]

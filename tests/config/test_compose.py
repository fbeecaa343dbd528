"""Hydra-style composition: defaults, group options, dotted overrides, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmdit_strict.cli.main import main
from mmdit_strict.config.compose import ConfigError, compose


def test_defaults() -> None:
    cfg = compose([])
    assert cfg.model.preset == "tiny" and cfg.runtime.mode == "strict" and cfg.sampler.num_steps == 6
    assert cfg._choices_.model == "tiny"


def test_group_and_key_overrides() -> None:
    cfg = compose(["runtime=off", "sampler.num_steps=3", "+extra.note=hi", "recompute.runtime=off", "sampler.sde=false"])
    assert cfg.runtime.mode == "off" and cfg.sampler.num_steps == 3 and cfg.extra.note == "hi"
    assert cfg.recompute.runtime == "off" and cfg.sampler.sde is False


def test_experiment_overrides_globals() -> None:
    cfg = compose(["experiment=recompute_off"])
    assert cfg.recompute.runtime == "off" and cfg.output_dir == "runs/recompute_off"
    # a command-line key still wins over the experiment
    assert compose(["experiment=recompute_off", "output_dir=elsewhere"]).output_dir == "elsewhere"


@pytest.mark.parametrize(
    "override, message",
    [
        ("sampler.stepz=3", "unknown config key 'sampler.stepz'; valid keys here: sampler.cfg_scale"),
        ("nope=1", "unknown config key 'nope'"),
        ("runtime=fast", "unknown option 'fast' for config group 'runtime'"),
        ("model.dtype=float16", "model.dtype='float16' is not one of"),
        ("sampler.num_steps=many", "bad value for sampler.num_steps"),
        ("justakey", "not of the form key=value"),
    ],
)
def test_bad_overrides(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        compose([override])


def test_unknown_key_in_a_yaml_file(tmp_path: Path) -> None:
    cdir = tmp_path / "configs"
    (cdir / "sampler").mkdir(parents=True)
    (cdir / "config.yaml").write_text("defaults:\n  - sampler: bad\n  - _self_\n")
    (cdir / "sampler" / "bad.yaml").write_text("num_stepz: 4\n")
    with pytest.raises(ConfigError, match="num_stepz"):
        compose([], config_dir=cdir)


def test_resolved_config_is_saved_and_cli_prints_it(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "sampler.num_steps=2"]) == 0
    assert "num_steps: 2" in capsys.readouterr().out
    assert main(["config", "sampler.bogus=1"]) == 2
    assert "unknown config key 'sampler.bogus'" in capsys.readouterr().err


def test_fingerprint_is_stable_and_sensitive(capsys: pytest.CaptureFixture) -> None:
    from mmdit_strict import fingerprint
    from mmdit_strict.config.arch import preset

    assert main(["fingerprint"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == fingerprint() and len(printed) == 64
    assert fingerprint(preset("tiny")) != fingerprint(preset("qwen-image"))
    assert fingerprint("tiny") == fingerprint(preset("tiny"))


@pytest.mark.parametrize("command", ["run", "rollout", "recompute", "compare", "report", "sample", "config", "fingerprint", "bench", "qualify", "operators"])
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    assert "usage: mmdit-strict" in capsys.readouterr().out


def test_operator_inventory_lists_every_operator(capsys: pytest.CaptureFixture) -> None:
    from mmdit_strict.kernels.registry import OPERATORS

    assert main(["operators", "--markdown"]) == 0
    out = capsys.readouterr().out
    for op in OPERATORS:
        assert f"| {op} |" in out
    # the CPU strict backend covers every model operator
    assert "| qkv_bias_gemm | cpu_strict | cpu | fp32 | yes |" in out


def test_missing_device_and_unknown_checkpoint_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import torch

    if not torch.cuda.is_available():
        assert main(["run", "--quiet", f"output_dir={tmp_path / 'a'}", "model.device=cuda", "wandb.mode=disabled"]) == 2
        assert "has no CUDA device" in capsys.readouterr().err
    assert main(["run", "--quiet", f"output_dir={tmp_path / 'b'}", f"model.checkpoint={tmp_path / 'nowhere'}", "wandb.mode=disabled"]) == 2
    assert "neither an existing folder nor a hub repo id" in capsys.readouterr().err


def test_docs_operator_inventory_is_current(capsys: pytest.CaptureFixture) -> None:
    """docs/operators.md carries the generated inventory; regenerate it when a backend changes."""
    assert main(["operators", "--markdown"]) == 0
    table = capsys.readouterr().out
    docs = (Path(__file__).resolve().parents[2] / "docs" / "operators.md").read_text()
    assert table.strip() in docs, "docs/operators.md is stale: paste `mmdit-strict operators --markdown` into it"


def test_an_experiment_extends_another_of_its_group() -> None:
    """``defaults: [grpo_qwen_image]`` in an experiment: that experiment's keys and group picks, this one's over them
    (hydra's way of extending a config); a command-line key still wins."""
    base = compose(["experiment=grpo_qwen_image"], command="train")
    lean = compose(["experiment=grpo_qwen_image_1024"], command="train")
    assert (lean.sampler.height, lean.sampler.width, base.sampler.height) == (1024, 1024, 512)
    assert lean.model.preset == base.model.preset == "qwen-image" and lean.lora == base.lora
    assert lean._choices_.train == "flow_grpo" and lean.train.learning_rate == base.train.learning_rate
    assert (lean.train.micro_batch * lean.train.gradient_accumulation_steps
            == base.train.micro_batch * base.train.gradient_accumulation_steps == 16)  # same pairs per update
    assert lean.train.park_lookahead == 0 and lean.train.carry_fold_nodes and not base.train.carry_fold_nodes
    assert compose(["experiment=grpo_qwen_image_1024", "train.park_fold_nodes=false"],
                   command="train").train.park_fold_nodes is False


def _experiments(tmp_path: Path, files: dict[str, str]) -> Path:
    cdir = tmp_path / "configs"
    (cdir / "experiment").mkdir(parents=True)
    (cdir / "config.yaml").write_text("defaults:\n  - _self_\n")
    for name, text in files.items():
        (cdir / "experiment" / f"{name}.yaml").write_text(text)
    return cdir


def test_extended_experiments_merge_in_order_and_refuse_loops_and_unknown_parents(tmp_path: Path) -> None:
    g = "# @package _global_\n"
    cdir = _experiments(tmp_path, {
        "a": g + "output_dir: a\nsampler:\n  num_steps: 3\n  height: 64\n",
        "b": g + "defaults:\n  - a\nsampler:\n  num_steps: 5\n",
        "c": g + "defaults:\n  - b\noutput_dir: c\n",
        "loop1": g + "defaults:\n  - loop2\n", "loop2": g + "defaults:\n  - loop1\n",
        "orphan": g + "defaults:\n  - nowhere\n",
        "local": "sampler:\n  num_steps: 2\n", "mixed": g + "defaults:\n  - local\n",
        "under": g + "defaults:\n  - _self_\n  - a\noutput_dir: under\nsampler:\n  num_steps: 9\n  width: 32\n",
    })
    cfg = compose(["experiment=c"], config_dir=cdir)
    assert (cfg.output_dir, cfg.sampler.num_steps, cfg.sampler.height) == ("c", 5, 64)
    cfg = compose(["experiment=under"], config_dir=cdir)  # _self_ first: the extended file's keys win, as in hydra
    assert (cfg.output_dir, cfg.sampler.num_steps, cfg.sampler.width) == ("a", 3, 32)
    with pytest.raises(ConfigError, match="defaults come back to it"):
        compose(["experiment=loop1"], config_dir=cdir)
    with pytest.raises(ConfigError, match="extend 'nowhere', which is not an option of its group"):
        compose(["experiment=orphan"], config_dir=cdir)
    with pytest.raises(ConfigError, match="only one of them is"):
        compose(["experiment=mixed"], config_dir=cdir)


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "configs" /
                                                               "experiment").glob("*.yaml")))
def test_every_shipped_experiment_composes_for_some_command(experiment: str) -> None:
    """Each file of ``configs/experiment`` (and the chain it extends) composes, validated, for at least one command."""
    from mmdit_strict.config.schema import SCHEMAS

    composed = []
    for command in SCHEMAS:
        try:
            composed.append(compose([f"experiment={experiment}"], command=command)._choices_.experiment)
        except ConfigError:
            continue
    assert composed and set(composed) == {experiment}

"""hydra habits on the command line: null, +/++/~ overrides, flags anywhere, multirun sweeps."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from mmdit_strict.cli.main import main
from mmdit_strict.config.compose import ConfigError, compose
from mmdit_strict.config.overrides import expand_multirun, parse_value, split_sweep


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("null", None), ("NULL", None), ("1", 1), ("1.5", 1.5), ("1e-3", 1e-3), ("true", True), ("False", False),
        ("off", "off"), ("on", "on"), ("yes", "yes"), ("'null'", "null"), ('"4"', "4"), ("[1, 2]", [1, 2]),
        ("{a: 1}", {"a": 1}), ("a: b", "a: b"), ("runs/x", "runs/x"), ("http://h:1/a", "http://h:1/a"),
        ("2024-01-01", "2024-01-01"), ("", ""), ("0o17", "0o17"),
    ],
)
def test_values_parse_like_hydra(raw, expected):
    assert parse_value(raw) == expected


def test_nan_value():
    assert math.isnan(parse_value("nan"))


def test_null_is_none():
    assert compose(["model.checkpoint=null"]).model.checkpoint is None
    assert compose(["model=qwen-image", "model.checkpoint=null"]).model.checkpoint is None
    assert compose(["model.checkpoint='null'"]).model.checkpoint == "null"
    assert compose(["rollout.runtime=null"]).rollout.runtime is None


def test_add_force_and_delete():
    cfg = compose(["+extra.a=1", "+extra.b=null", "++extra.a=2", "++extra.c=[1,2]"])
    assert dict(cfg.extra) == {"a": 2, "b": None, "c": [1, 2]}
    assert "a" not in compose(["+extra.a=1", "~extra.a"]).extra
    assert "a" not in compose(["+extra.a=1", "~extra.a=1"]).extra
    assert compose(["experiment=no_lora", "~experiment"])._choices_.get("experiment") is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["~model.checkpoint"], "schema field"),
        (["+extra.a=1", "+extra.a=2"], r"already exists .*\+\+extra\.a"),
        (["+sampler.num_steps=3"], "already exists"),
        (["+extra.a=1", "~extra.a=2"], "holds 1, not 2"),
        (["~extra.zz"], "no such key"),
        (["~+extra.a"], "one prefix"),
        (["novalue"], "key=value"),
    ],
)
def test_bad_overrides(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose(overrides)


def test_flags_anywhere(capsys):
    assert main(["config", "sampler.num_steps=3", "--quiet", "runtime=off", "--config-dir",
                 str(Path(__file__).resolve().parents[2] / "configs"), "model.checkpoint=null"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["sampler"]["num_steps"] == 3 and cfg["runtime"]["mode"] == "off" and cfg["model"]["checkpoint"] is None
    assert main(["config", "+extra.a=1", "--quiet", "~extra.a", "--config-dir",
                 str(Path(__file__).resolve().parents[2] / "configs")]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["extra"] == {}
    with pytest.raises(SystemExit):
        main(["config", "a=1", "--bogus"])
    with pytest.raises(SystemExit):
        main(["compare", "a", "b", "c=1"])  # compare takes no overrides


def test_sweep_split_and_product():
    assert split_sweep("a,[1,2],'x,y',{k: 1, j: 2}") == ["a", "[1,2]", "'x,y'", "{k: 1, j: 2}"]
    jobs = expand_multirun(["sampler.num_steps=4,8", "runtime=strict,off", "+extra.l=[1,2]", "~extra.q"])
    assert [j[:2] for j in jobs] == [
        ["sampler.num_steps=4", "runtime=strict"], ["sampler.num_steps=4", "runtime=off"],
        ["sampler.num_steps=8", "runtime=strict"], ["sampler.num_steps=8", "runtime=off"],
    ]
    assert all(j[2:] == ["+extra.l=[1,2]", "~extra.q"] for j in jobs)


def test_multirun_numbered_folders(tmp_path, capsys):
    out = tmp_path / "sweep"
    rc = main(["config", "-m", "sampler.num_steps=4,8", "runtime=strict,off", f"output_dir={out}"])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.count("[multirun] job ") == 4
    parts = [yaml.safe_load(part.split("\n", 1)[1].split("[multirun]")[0]) for part in text.split("[multirun] job ")[1:]]
    assert [(p["sampler"]["num_steps"], p["runtime"]["mode"], p["output_dir"]) for p in parts] == [
        (4, "strict", str(out / "0")), (4, "off", str(out / "1")), (8, "strict", str(out / "2")), (8, "off", str(out / "3"))]
    record = yaml.safe_load((out / "multirun.yaml").read_text())["jobs"]
    assert [r["output_dir"] for r in record] == [str(out / str(i)) for i in range(4)]
    assert [r["exit_code"] for r in record] == [0] * 4
    assert record[3]["overrides"][:2] == ["sampler.num_steps=8", "runtime=off"]
    assert main(["config", "-m", "output_dir=a,b"]) == 2


def test_multirun_rollouts(tmp_path):
    out = tmp_path / "mr"
    rc = main(["rollout", "-m", "sampler.num_steps=1,2", "--quiet", f"output_dir={out}", "prompts.num_prompts=1",
               "rollout.batch_size=1", "sampler.height=32", "sampler.width=32", "lora.rank=0", "runtime=off"])
    assert rc == 0
    for i, steps in enumerate((1, 2)):
        assert yaml.safe_load((out / str(i) / "config.yaml").read_text())["sampler"]["num_steps"] == steps
        assert (out / str(i) / "rollout").is_dir()

"""`mmdit-strict ablate`: the plan's checks, a small ablation end to end (a probe, a control, two runtime
combinations, two probes declared only in the config: one caught elsewhere, one never caught), resume,
errors, and the standard tiny ablation (experiment=ablation_tiny) as CI runs it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from mmdit_strict.ablation.plan import PlanError, plan
from mmdit_strict.cli.main import main
from mmdit_strict.config.compose import compose

SMALL = ["model.num_layers=1", "sampler.num_steps=2", "prompts.num_prompts=3", "rollout.batch_size=3", "--quiet"]


def _plan(entries: list[Any], **section: Any):
    cfg = compose(["model.num_layers=1"], command="ablate")  # composed without the entry check
    return plan(OmegaConf.merge(cfg, {"ablation": {"entries": entries, **section}}))


@pytest.mark.parametrize("entry, message", [
    ({"name": "a", "kind": "probes", "perturb": "gelu_exact"}, "kind must be one of probe, control, combination, got 'probes'"),
    ({"name": "a", "kind": "probe", "perturb": "gelu_exact", "side": "trainer"}, "side must be one of rollout, recompute, got 'trainer'"),
    ({"name": "a", "kind": "probe", "perturb": "gelu_exakt"}, "perturb='gelu_exakt' is no registered perturbation; choose one of"),
    ({"name": "a", "kind": "probe", "perturb": "gelu_exact", "expect": "block0.img.mlp_upp"}, "'block0.img.mlp_upp' is no operator key"),
    ({"name": "a", "kind": "probe", "overrides": ["recompute.inject_fault=block3.img.mlp_down_gemm@1"],
      "expect": "block3.img.mlp_down_gemm"}, "names block 3 but the model has 1 blocks"),
    ({"name": "a", "kind": "probe", "overrides": ["recompute.inject_fault=block0.img.mlp_down_gemm@1"]},
     "a probe without a perturbation needs expect"),
    ({"name": "a", "kind": "probe", "expect": "block0.img.mlp_down_gemm"}, "a probe must change something"),
    ({"name": "a", "kind": "control", "expect": "drift"}, "a control expects 'identical', got 'drift'"),
    ({"name": "a", "kind": "combination", "overrides": ["recompute.runtime=off"]}, "a combination needs expect: identical or drift"),
    ({"name": "a", "kind": "control", "expected": "identical"}, "unknown field(s) expected"),
    ({"name": "a b", "kind": "control"}, "name must be a folder name"),
    ({"name": "ablation", "kind": "control"}, "the name 'ablation' is reserved"),
    ({"name": "a", "kind": "control", "overrides": ["recompute.micro_batch"]}, "is not of the form key=value"),
    ("a", "must be a mapping"),
])
def test_an_entry_that_cannot_run_is_named(entry: Any, message: str) -> None:
    with pytest.raises(PlanError) as info:
        _plan([entry])
    assert message in str(info.value)
    if isinstance(entry, dict) and entry["name"] not in ("a b",):
        assert f"ablation entry {entry['name']!r}" in str(info.value)


def test_plan_expands_probes_and_filters() -> None:
    entries = _plan([{"name": "gelu_exact", "kind": "probe", "perturb": "gelu_exact", "side": "rollout"},
                     {"name": "c", "kind": "control"}], probes="all")
    by_name = {e.name: e for e in entries}
    assert by_name["gelu_exact"].side == "rollout"  # the listed entry, not the expanded one
    assert by_name["qk_norm_eps"].expect == "block0.img.q.qk_rmsnorm" and by_name["qk_norm_eps"].side == "recompute"
    assert by_name["qk_norm_eps"].job_overrides() == ["recompute.perturb=qk_norm_eps"]
    assert by_name["c"].expect == "identical"
    assert [e.name for e in _plan([{"name": "c", "kind": "control"}], probes="all", only=["c", "sigma_shift"])] == ["sigma_shift", "c"]
    with pytest.raises(PlanError, match="listed twice"):
        _plan([{"name": "c", "kind": "control"}, {"name": "c", "kind": "control"}])
    with pytest.raises(PlanError, match="ablation.only names no entry 'x'"):
        _plan([{"name": "c", "kind": "control"}], only=["x"])
    with pytest.raises(PlanError, match="ablation has no entries: pick experiment=ablation_tiny"):
        _plan([])


def test_bad_entries_exit_2_before_anything_is_written(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "abl"
    assert main(["ablate", f"output_dir={out}", "ablation.entries=[{name: x, kind: nope}]", *SMALL]) == 2
    assert "kind must be one of probe, control, combination, got 'nope'" in capsys.readouterr().err
    # an override the job's run config refuses is found before the first job runs
    assert main(["ablate", f"output_dir={out}", "ablation.entries=[{name: x, kind: control, overrides: [recompute.micro_bach=1]}]",
                 *SMALL]) == 2
    err = capsys.readouterr().err
    assert "ablation entry 'x'" in err and "unknown config key 'recompute.micro_bach'" in err and "no entry was run" in err
    # so is a perturbation its side cannot run (this one rewrites the strict graph's arguments)
    assert main(["ablate", f"output_dir={out}", "ablation.entries=[{name: y, kind: probe, perturb: image_first, "
                 "overrides: [recompute.runtime=off]}]", *SMALL]) == 2
    err = capsys.readouterr().err
    assert "ablation entry 'y'" in err and "recompute.perturb='image_first' rewrites the strict graph's arguments" in err
    assert not out.exists()
    assert main(["ablate", f"output_dir={out}"]) == 2  # no experiment: no entries
    assert "ablation has no entries" in capsys.readouterr().err
    assert main(["run", "experiment=ablation_tiny", f"output_dir={out}"]) == 2  # an ablate experiment is not a run's
    assert "does not read" in capsys.readouterr().err
    assert not out.exists()


ENTRIES = [
    {"name": "gelu", "kind": "probe", "perturb": "gelu_exact"},
    # declared only here: caught, but at another operator than it says (exit 1, named)
    {"name": "planted_wrong", "kind": "probe", "overrides": ["recompute.inject_fault=block0.img.mlp_down_gemm@1"],
     "expect": "block0.img.mlp_up_gemm_gelu"},
    # declared only here: changes nothing strict mode sees, so it is not caught (exit 1, named)
    {"name": "planted_silent", "kind": "probe", "overrides": ["recompute.shuffle_seed=5"], "expect": "block0.img.mlp_down_gemm"},
    {"name": "batch_size", "kind": "control", "overrides": ["recompute.micro_batch=1"]},
    {"name": "strict_strict", "kind": "combination", "overrides": ["rollout.runtime=strict", "recompute.runtime=strict"],
     "expect": "identical"},
    {"name": "production_production", "kind": "combination", "overrides": ["rollout.runtime=off", "recompute.runtime=off"],
     "expect": "drift"},
]


def _entries_override(entries: list[dict[str, Any]]) -> str:
    return "ablation.entries=" + json.dumps(entries)


@pytest.mark.slow
def test_small_ablation_end_to_end_and_resume(tmp_path: Path, capsys: pytest.CaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "abl"
    argv = ["ablate", f"output_dir={out}", _entries_override(ENTRIES), *SMALL]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "failed: planted_wrong: caught at block0.img.mlp_down_gemm, expected block0.img.mlp_up_gemm_gelu" in captured.err
    assert "failed: planted_silent: not caught" in captured.err
    assert "[ablate] gelu" in captured.out and f"report: {out / 'ablation' / 'report.md'}" in captured.out

    report = json.loads((out / "ablation" / "report.json").read_text())
    assert report["passed"] is False
    rows = {r["name"]: r for kind in ("probes", "controls", "combinations") for r in report[kind]}
    assert [r["name"] for r in report["probes"]] == ["gelu", "planted_wrong", "planted_silent"]
    assert [r["name"] for r in report["controls"]] == ["batch_size"]
    assert [r["name"] for r in report["combinations"]] == ["strict_strict", "production_production"]
    for r in rows.values():
        assert {"name", "expected", "first_drift", "passed"} <= set(r)
    gelu = rows["gelu"]
    assert gelu["passed"] and gelu["expected"] == "block0.img.mlp_up_gemm_gelu"
    assert gelu["first_drift"]["key"] == "block0.img.mlp_up_gemm_gelu" and gelu["first_drift"]["step"] == 0
    assert not rows["planted_wrong"]["passed"] and rows["planted_wrong"]["first_drift"]["key"] == "block0.img.mlp_down_gemm"
    assert rows["planted_wrong"]["first_drift"]["step"] == 1
    assert not rows["planted_silent"]["passed"] and rows["planted_silent"]["first_drift"] is None
    assert rows["batch_size"]["passed"] and rows["batch_size"]["first_drift"] is None
    strict = rows["strict_strict"]
    assert strict["passed"] and strict["logp_bytes_differ"] == 0 and strict["max_ratio_dev"] == 0.0
    assert strict["logp_values"] == 2 * 3 and strict["runtimes"] == ["strict", "strict"]
    prod = rows["production_production"]
    assert prod["passed"] and prod["first_drift"] is not None and prod["runtimes"] == ["off", "off"]
    assert prod["max_abs_dlogp"] >= 0 and len(prod["ratio_dev_per_step"]) == 2 and len(prod["curves"]["v_max_abs"]) == 2
    assert prod["reward"]["name"] == "latent_stats" and prod["time_split"]["recompute"]["communication"] == 0.0
    assert prod["time_split"]["rollout"]["vae"].startswith("not run")
    assert sorted(report["failures"]) == sorted([f"planted_wrong: {rows['planted_wrong']['reason']}",
                                                 f"planted_silent: {rows['planted_silent']['reason']}"])

    md = (out / "ablation" / "report.md").read_text()
    first_table = md.split("\n\n")[2]
    assert first_table.startswith("| entry | kind | expected | observed first drift")
    assert "| gelu | probe | block0.img.mlp_up_gemm_gelu | `block0.img.mlp_up_gemm_gelu` (step 0, block 0, row" in md
    assert "**FAIL**: caught at block0.img.mlp_down_gemm, expected block0.img.mlp_up_gemm_gelu" in md
    assert "## Rollout runtime × recompute runtime" in md and "| strict_strict | strict / strict | identical | identical | 0 of 6 |" in md
    for png in ("combinations_drift_per_step.png", "combinations_ratio_per_step.png"):
        assert (out / "ablation" / png).stat().st_size > 1000

    status = yaml.safe_load((out / "ablation.yaml").read_text())["entries"]
    assert [(s["entry"], s["status"]) for s in status] == [
        ("gelu", "passed"), ("planted_wrong", "failed"), ("planted_silent", "failed"), ("batch_size", "passed"),
        ("strict_strict", "passed"), ("production_production", "passed")]
    # entries with the same rollout settings share one rollout (hard links of the first one's files)
    tensors = [(out / n / "rollout" / "tensors.safetensors").stat().st_ino for n in ("gelu", "batch_size", "strict_strict")]
    assert len(set(tensors)) == 1

    # a rerun reuses every verified stage: no rollout and no recompute runs again
    import mmdit_strict.trajectories.pipeline as pipeline

    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("a stage ran again on resume")

    monkeypatch.setattr(pipeline, "run_rollout", refuse)
    monkeypatch.setattr(pipeline, "run_recompute", refuse)
    assert main(argv) == 1
    again = json.loads((out / "ablation" / "report.json").read_text())
    assert [(r["name"], r["passed"], r["first_drift"]) for r in again["probes"] + again["controls"] + again["combinations"]] == \
        [(r["name"], r["passed"], r["first_drift"]) for r in report["probes"] + report["controls"] + report["combinations"]]


def test_a_job_error_is_recorded_and_the_others_run(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import mmdit_strict.trajectories.pipeline as pipeline

    ran = []

    def crash(cfg: Any, progress: bool = True) -> None:
        ran.append(Path(cfg.output_dir).name)
        raise RuntimeError(f"died in {Path(cfg.output_dir).name}")

    monkeypatch.setattr(pipeline, "run_all", crash)
    out = tmp_path / "abl"
    entries = [{"name": "c1", "kind": "control"}, {"name": "c2", "kind": "control", "overrides": ["recompute.micro_batch=1"]}]
    assert main(["ablate", f"output_dir={out}", _entries_override(entries), *SMALL]) == 2
    assert ran == ["c1", "c2"]
    assert "error: c1: error: RuntimeError: died in c1" in capsys.readouterr().err
    status = yaml.safe_load((out / "ablation.yaml").read_text())["entries"]
    assert [(s["status"], s["exit_code"]) for s in status] == [("error", 2), ("error", 2)]
    report = json.loads((out / "ablation" / "report.json").read_text())
    assert [r["status"] for r in report["controls"]] == ["error", "error"]
    assert "**ERROR**: error: RuntimeError: died in c2" in (out / "ablation" / "report.md").read_text()


def test_list_prints_every_registered_perturbation(capsys: pytest.CaptureFixture) -> None:
    from mmdit_strict.overlay import get_perturbation, known_perturbations

    assert main(["ablate", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(known_perturbations())
    for name, line in zip(known_perturbations(), lines):
        p = get_perturbation(name)
        assert line.startswith(name) and p.caught_at in line and p.description in line


def test_docs_list_every_registered_probe_where_it_is_caught() -> None:
    from mmdit_strict.overlay import get_perturbation, known_perturbations

    doc = (Path(__file__).resolve().parents[2] / "docs" / "ablation.md").read_text()
    for name in known_perturbations():
        p = get_perturbation(name)
        assert f"| `{name}` | {p.factor} | {p.description} | `{p.caught_at}` |" in doc, f"docs/ablation.md lacks the row of {name}"


@pytest.mark.slow
def test_standard_tiny_ablation_passes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """CI's bar: every probe caught at its declared operator, every control byte-identical, strict/strict with
    no logp byte differing and production/production drifting; exit 0 (about 80 s on 2 cores)."""
    out = tmp_path / "abl"
    rc = main(["ablate", "experiment=ablation_tiny", f"output_dir={out}", "--quiet"])
    report = json.loads((out / "ablation" / "report.json").read_text())
    assert rc == 0, report["failures"]
    rows = report["probes"] + report["controls"] + report["combinations"]
    assert all(r["passed"] for r in rows)
    from mmdit_strict.overlay import known_perturbations

    assert {r["name"] for r in report["probes"]} == {*known_perturbations(), "planted_fault"}
    assert all(r["first_drift"]["key"] for r in report["probes"])
    combos = {r["name"]: r for r in report["combinations"]}
    assert combos["strict_strict"]["logp_bytes_differ"] == 0 and combos["strict_strict"]["first_drift"] is None
    assert combos["production_production"]["first_drift"] is not None

"""The perturbation overlay: every registered probe is caught by the localizer at the operator it declares,
the sampling chain is traced and localized like the model, and no overlay means nothing changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmdit_strict.overlay import PERTURBATIONS, get_perturbation, perturbing
from mmdit_strict.config.compose import compose
from mmdit_strict.kernels.execution import current
from mmdit_strict.trajectories.pipeline import run_all

# one block, two steps, two prompts: every probe acts on block 0, the embedding or the sampling chain
SMALL = ["model.num_layers=1", "sampler.num_steps=2", "prompts.num_prompts=2", "recompute.micro_batch=1",
         "wandb.mode=disabled", "progress=false"]


def _run(out: Path, *overrides: str):
    return run_all(compose([f"output_dir={out}", *SMALL, *overrides]), progress=False)


def _base_key(key: str) -> str:
    parts = key.split(".")
    return ".".join(parts[:-1]) if parts[-1].isdigit() else key


# one model operator, one sampling operator, one keyed on the sample ids; every registered probe is checked by
# the standard ablation (tests/ablation/test_ablate.py::test_standard_tiny_ablation_passes)
@pytest.mark.parametrize("name", ["gelu_exact", "cfg_no_renorm", "noise_rank_local"])
def test_a_probe_is_caught_at_its_declared_operator(tmp_path: Path, name: str) -> None:
    result = _run(tmp_path, f"recompute.perturb={name}")
    assert not result.byte_identical, f"{name}: the perturbed recompute stayed byte-identical"
    loc = result.localization
    assert loc is not None and loc.first is not None, f"{name}: not localized ({loc and loc.notes})"
    assert _base_key(loc.first.key) == get_perturbation(name).caught_at, loc.first
    manifest = json.loads((tmp_path / "recompute" / "manifest.json").read_text())
    assert manifest["side"]["perturb"] == name and manifest["side"]["perturb_hits"] > 0
    assert any(name in n for n in loc.notes)


def test_a_rollout_side_probe_is_caught_too(tmp_path: Path) -> None:
    result = _run(tmp_path, "rollout.perturb=cfg_no_renorm")
    assert result.localization.first.key == "sampling.cfg_combine_renorm"
    assert result.localization.first.branch == "sampling"
    assert "sampling chain" in result.summary


def test_sampling_fault_is_named_at_its_operator_step_and_sample(tmp_path: Path) -> None:
    result = _run(tmp_path, "recompute.inject_fault=sampling.flow_sde_step_logp@1")
    first = result.comparison.first
    assert (first.step, first.quantity) == (1, "x")
    assert result.localization.first.key == "sampling.flow_sde_step_logp.0"
    assert (result.localization.first.logical_row, result.localization.first.element) == (0, 0)


def test_sampling_operators_are_in_the_operator_trace(tmp_path: Path) -> None:
    _run(tmp_path)
    for side in ("rollout", "recompute"):
        ops = {r["op"]: r for r in json.loads((tmp_path / side / "trace.json").read_text())["operators"]}
        for op in ("flow_sigma_table", "cfg_combine_renorm", "flow_sde_step_logp"):
            assert ops[op]["actual_backend"] == "torch_fixed" and ops[op]["calls"] > 0, (side, op)
    rollout = {r["op"]: r["calls"] for r in json.loads((tmp_path / "rollout" / "trace.json").read_text())["operators"]}
    # the rollout's batch of 2: one CFG combine and one SDE step per step, the table read once
    assert (rollout["flow_sigma_table"], rollout["cfg_combine_renorm"], rollout["flow_sde_step_logp"]) == (1, 2, 2)


def test_no_overlay_binds_nothing_and_unknown_names_are_refused() -> None:
    with perturbing(None) as overlay:
        assert overlay is None and current().overlay is None
    with perturbing("gelu_exact") as overlay:
        assert current().overlay is overlay and overlay.perturbation is PERTURBATIONS["gelu_exact"]
    assert current().overlay is None
    with pytest.raises(ValueError, match="unknown perturbation 'nope'"):
        with perturbing("nope"):
            pass
    with pytest.raises(ValueError, match="cannot run on a runtime=off side"):
        with perturbing("image_first", runtime="off"):
            pass


def test_a_run_refuses_unknown_and_off_incompatible_probes_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no registered perturbation"):
        _run(tmp_path / "a", "recompute.perturb=nope")
    with pytest.raises(ValueError, match="rollout runs runtime=off"):
        _run(tmp_path / "b", "rollout.perturb=image_first", "rollout.runtime=off")
    assert not (tmp_path / "a" / "rollout").exists() and not (tmp_path / "b" / "rollout").exists()


def test_a_probe_is_applied_on_its_side_only(tmp_path: Path) -> None:
    """The rollout is the baseline's bytes when only the recompute is perturbed."""
    base = _run(tmp_path / "base")
    probed = _run(tmp_path / "probe", "recompute.perturb=qk_norm_eps")
    assert base.byte_identical
    a = (tmp_path / "base" / "rollout" / "tensors.safetensors").read_bytes()
    b = (tmp_path / "probe" / "rollout" / "tensors.safetensors").read_bytes()
    assert a == b and not probed.byte_identical

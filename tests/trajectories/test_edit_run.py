"""The main job with edit conditioning (issue 33): rollout vs recompute byte-identical with mixed input-image
sizes, the conditioning recorded as replay input with its hash and in both stage keys, a planted fault in a
conditioning row localized there, clear errors for bad edit inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmdit_strict.config.compose import compose
from mmdit_strict.trajectories import artifact
from mmdit_strict.trajectories.hashing import tensor_sha256
from mmdit_strict.trajectories.pipeline import run_all

EDIT = ["experiment=edit_tiny", "sampler.num_steps=2", "prompts.num_prompts=3", "wandb.mode=disabled", "progress=false"]


def _run(out: Path, *overrides: str):
    return run_all(compose([f"output_dir={out}", *EDIT, *overrides]), progress=False)


def test_edit_run_is_byte_identical_and_records_its_conditioning(tmp_path: Path) -> None:
    result = _run(tmp_path / "edit")
    assert result.byte_identical, result.summary
    rollout = artifact.read(tmp_path / "edit" / "rollout")
    recompute = artifact.read(tmp_path / "edit" / "recompute")
    cond = rollout.manifest["conditioning"]
    assert cond["grids"] == [[4, 4], [2, 6], [6, 3]]  # the three sizes of edit_tiny, one per sample
    for i, h in enumerate(cond["sha256"]):
        latents = rollout.tensors[f"condition.{i}"]
        assert tuple(latents.shape) == (cond["grids"][i][0] * cond["grids"][i][1], 64)
        assert tensor_sha256(latents) == h
    assert recompute.manifest["conditioning"] == cond  # the recompute replayed the recorded bytes
    for side in (rollout, recompute):
        assert side.manifest["stage_key"]["conditioning_sha256"] not in (None, "none")
    assert rollout.manifest["stage_key"]["conditioning_sha256"] == recompute.manifest["stage_key"]["conditioning_sha256"]


@pytest.mark.slow
@pytest.mark.extended  # the row owner / adapter / run parts are covered by faster tests
def test_two_input_images_per_prompt_run_is_byte_identical(tmp_path: Path) -> None:
    """`mmdit-strict run experiment=edit_tiny prompts.edit.images_per_prompt=2` (Qwen-Image-Edit-Plus layout:
    two input images per sample, each its own grid, sizes mixed across the batch) exits 0, byte-identical;
    every image's grid and sha256 recorded, and the recompute replays them byte for byte."""
    from mmdit_strict.cli.main import main

    assert main(["run", f"output_dir={tmp_path / 'plus'}", *EDIT, "prompts.edit.images_per_prompt=2"]) == 0
    rollout = artifact.read(tmp_path / "plus" / "rollout")
    recompute = artifact.read(tmp_path / "plus" / "recompute")
    cond = rollout.manifest["conditioning"]
    assert cond["grids"] == [[[4, 4], [2, 6]], [[2, 6], [6, 3]], [[6, 3], [4, 4]]]
    assert cond["tokens"] == [28, 30, 34]
    for i, per_image in enumerate(cond["images"]):
        latents = rollout.tensors[f"condition.{i}"]
        assert tensor_sha256(latents) == cond["sha256"][i]
        start = 0
        for k, im in enumerate(per_image):
            assert im["grid"] == cond["grids"][i][k]
            rows = im["grid"][0] * im["grid"][1]
            assert tensor_sha256(latents[start:start + rows].contiguous()) == im["sha256"]
            start += rows
        assert start == latents.shape[0]
    assert recompute.manifest["conditioning"] == cond
    one = compose([f"output_dir={tmp_path}", *EDIT])
    from mmdit_strict.config.arch import preset
    from mmdit_strict.trajectories.setup import make_prompts

    single = make_prompts(one.prompts, preset("tiny"), "cpu", "float32").hashes()["images"]
    assert [im[0]["sha256"] for im in cond["images"]] == [h["sha256"] for h in single]  # image 0: the one-image draw


def test_conditioning_is_part_of_the_rollout_key(tmp_path: Path) -> None:
    from mmdit_strict.trajectories.setup import make_prompts
    from mmdit_strict.trajectories.stagekey import rollout_key
    from mmdit_strict.config.arch import preset

    keys = []
    for seed in (0, 1):
        cfg = compose([f"output_dir={tmp_path}", *EDIT, f"prompts.edit.seed={seed}"])
        prompts = make_prompts(cfg.prompts, preset("tiny"), "cpu", "float32")
        keys.append(rollout_key(cfg, {"fingerprint": "f", "weights_sha256": "w", "lora_sha256": None}, prompts.hashes()))
    assert keys[0]["conditioning_sha256"] != keys[1]["conditioning_sha256"]
    t2i = make_prompts(compose([f"output_dir={tmp_path}"]).prompts, preset("tiny"), "cpu", "float32")
    assert "images" not in t2i.hashes() and t2i.images is None


def test_fault_in_a_conditioning_row_is_localized_there(tmp_path: Path) -> None:
    # packed row 70 of the forward: the first sample's noisy latents are rows 0..63, its input image follows
    result = _run(tmp_path / "fault", "recompute.inject_fault=block0.img.mlp_down_gemm#70@1")
    assert not result.byte_identical
    first = result.localization.first
    assert first.key == "block0.img.mlp_down_gemm" and first.block == 0 and first.stream == "img"
    assert first.logical_row == 70 and first.region == "conditioning image" and first.region_row == 6
    assert "conditioning image row 6, not the noisy latent" in result.summary


def test_fault_in_a_noisy_row_is_not_called_conditioning(tmp_path: Path) -> None:
    result = _run(tmp_path / "noisy", "recompute.inject_fault=block0.img.mlp_down_gemm#5@1")
    first = result.localization.first
    assert first.logical_row == 5 and first.region == "noisy latent"
    assert "conditioning image" not in result.summary


def test_latents_file_source(tmp_path: Path) -> None:
    from mmdit_strict.model.edit import ConditionImage
    from mmdit_strict.trajectories.conditioning import make_images, read_latents_file, write_latents_file
    from mmdit_strict.config.arch import preset

    ims = [ConditionImage(torch.randn(6, 64), (2, 3)), ConditionImage(torch.randn(4, 64), (1, 4))]
    path = write_latents_file(tmp_path / "c.safetensors", ims)
    back = read_latents_file(path, 64)
    assert [b.grid for b in back] == [(2, 3), (1, 4)] and all(torch.equal(a.latents, b.latents) for a, b in zip(ims, back))
    cfg = compose([f"output_dir={tmp_path}", "prompts.edit.source=latents", f"prompts.edit.latents={path}"])
    got = make_images(cfg.prompts.edit, 3, preset("tiny"))
    assert [g.grid for g in got] == [(2, 3), (1, 4), (2, 3)]  # cycled over samples


def test_latents_file_with_several_images_per_entry(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from mmdit_strict.model.edit import ConditionImage, Conditioning
    from mmdit_strict.trajectories.conditioning import read_latents_file, write_latents_file

    two = Conditioning([ConditionImage(torch.randn(6, 64), (2, 3)), ConditionImage(torch.randn(4, 64), (2, 2))])
    one = ConditionImage(torch.randn(4, 64), (1, 4))
    back = read_latents_file(write_latents_file(tmp_path / "c.safetensors", [two, one]), 64)
    assert [b.grids for b in back] == [((2, 3), (2, 2)), ((1, 4),)] and isinstance(back[1], ConditionImage)
    assert torch.equal(back[0].latents, two.latents) and torch.equal(back[0].images[1].latents, two.images[1].latents)
    save_file({"latents.0": torch.zeros(9, 64), "grid.0": torch.tensor([[2, 3], [2, 2]])}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=r"latents.0 must be \(Σ h·w, 64\)"):
        read_latents_file(tmp_path / "bad.safetensors", 64)


def test_prompt_file_with_per_prompt_negatives(tmp_path: Path) -> None:
    """negative_embeds (N, L, C) + negative_mask: each prompt's own negative, hashed and recorded; bad files
    and a wrong negative count in the CFG forward are refused."""
    from omegaconf import OmegaConf
    from safetensors.torch import save_file

    from mmdit_strict.config.arch import preset
    from mmdit_strict.model import build_model
    from mmdit_strict.trajectories.engine import velocity
    from mmdit_strict.trajectories.setup import make_prompts

    D = preset("tiny").joint_attention_dim
    neg, nmask = torch.randn(2, 5, D), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    base = {"prompt_embeds": torch.randn(2, 4, D), "prompt_mask": torch.ones(2, 4, dtype=torch.long), "negative_embeds": neg}
    save_file({**base, "negative_mask": nmask}, str(tmp_path / "ok.safetensors"))
    prompts = make_prompts(OmegaConf.create({"embeddings": str(tmp_path / "ok.safetensors")}), preset("tiny"), "cpu", "float32")
    assert [tuple(e.shape) for e in prompts.negatives] == [(3, D), (5, D)] and torch.equal(prompts.negative, neg[0, :3])
    assert prompts.hashes()["negatives"] == [tensor_sha256(neg[0, :3]), tensor_sha256(neg[1])]
    for name, extra, message in (("nomask", {}, "need negative_mask"),
                                 ("count", {"negative_embeds": torch.randn(3, 5, D), "negative_mask": torch.ones(3, 5)},
                                  "3 per-prompt negatives for 2 prompts"),
                                 ("empty", {"negative_mask": torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])}, "at least one valid")):
        save_file({**base, **extra}, str(tmp_path / f"{name}.safetensors"))
        with pytest.raises(ValueError, match=message):
            make_prompts(OmegaConf.create({"embeddings": str(tmp_path / f"{name}.safetensors")}), preset("tiny"), "cpu", "float32")
    model = build_model(preset("tiny"), seed=0, runtime="strict")
    with pytest.raises(ValueError, match="one per sample: 2 samples, 1 negatives"):
        velocity(model, torch.randn(2, 4, 64), prompts.embeds, prompts.negatives[:1], 0.5, (2, 2), 4.0, "batched")


@pytest.mark.parametrize("overrides, message", [
    (["prompts.edit.sizes=[[40,64]]"], "multiples of 16"),
    (["prompts.edit.source=latents"], "needs prompts.edit.latents"),
    (["prompts.edit.source=latents", "prompts.edit.latents=/nonexistent.safetensors"], "is not a file"),
    (["prompts.edit.source=folder"], "encoded by `mmdit-strict run`"),
    (["prompts.edit.source=pictures"], "must be one of"),
    (["prompts.edit.images_per_prompt=0"], "images_per_prompt must be a count >= 1"),
    (["prompts.edit.images_per_prompt=[]"], "images_per_prompt must be a count >= 1"),
])
def test_bad_edit_inputs_are_refused(tmp_path: Path, overrides: list[str], message: str) -> None:
    from mmdit_strict.trajectories.setup import make_prompts
    from mmdit_strict.config.arch import preset

    cfg = compose([f"output_dir={tmp_path}", *EDIT, *overrides])
    with pytest.raises(ValueError, match=message):
        make_prompts(cfg.prompts, preset("tiny"), "cpu", "float32")


def test_gpu_edit_config_composes() -> None:
    cfg = compose(["experiment=gpu_edit_job"])
    assert cfg.model.preset == "qwen-image" and cfg.model.num_layers == 4 and cfg.model.device == "cuda"
    assert (cfg.sampler.height, cfg.sampler.width) == (1024, 1024) and cfg.prompts.edit.source == "seeded"
    assert [list(s) for s in cfg.prompts.edit.sizes][0] == [1024, 1024]

"""`mmdit-strict run` on a Qwen-Image-Edit-Plus folder (the tiny random one): prompt text plus one subfolder of
input pictures per prompt. Each prompt and its negative are encoded with the prompt's pictures, each picture
is VAE-encoded on its own grid after resizing to prompts.edit.vae_area, and rollout vs recompute stay
byte-identical with per-prompt negatives and mixed image counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmdit_strict.trajectories import artifact
from tests.pipelines.test_encode_edit import _picture


def test_plus_folder_run_with_pictures_per_prompt(tiny_plus_pipeline_dir: Path, tmp_path: Path) -> None:
    from mmdit_strict.cli.main import main
    from mmdit_strict.pipelines.encode import read_prompt_metadata

    pics = tmp_path / "pics"
    for sub, sizes in (("a", [(48, 32), (32, 32)]), ("b", [(64, 32)])):
        (pics / sub).mkdir(parents=True)
        for k, (w, h) in enumerate(sizes):
            _picture(w, h, 10 * k + len(sub)).save(pics / sub / f"{k}.png")
    out = tmp_path / "run"
    assert main(["run", f"model.checkpoint={tiny_plus_pipeline_dir}", f"output_dir={out}", "prompts.text=[swap them,make it red]",
                 "sampler.num_steps=2", "sampler.height=32", "sampler.width=32", "prompts.edit.source=folder",
                 f"prompts.edit.folder={pics}", "prompts.edit.vae_area=1024", "wandb.mode=disabled", "progress=false"]) == 0
    meta = read_prompt_metadata(out / "prompts.safetensors")
    assert json.loads(meta["images"]) == [["a/0.png", "a/1.png"], ["b/0.png"]] and "own images" in meta["negative_conditioning"]
    rollout = artifact.read(out / "rollout")
    cond = rollout.manifest["conditioning"]
    assert cond["grids"] == [[[2, 2], [2, 2]], [2, 2]]  # ~1024 px each at its aspect ratio, sides multiples of 32; one picture: [h, w]
    assert [len(im) for im in cond["images"]] == [2, 1]
    negatives = rollout.manifest["prompt_hashes"]["negatives"]
    assert len(negatives) == 2 and negatives[0] != negatives[1]  # each negative saw its own pictures
    assert artifact.read(out / "recompute").manifest["prompt_hashes"] == rollout.manifest["prompt_hashes"]


def test_bad_picture_folders_are_refused(tmp_path: Path) -> None:
    from mmdit_strict.pipelines.edit_inputs import load_picture_sets

    with pytest.raises(ValueError, match="is not a folder"):
        load_picture_sets(tmp_path / "missing")
    (tmp_path / "mixed" / "a").mkdir(parents=True)
    _picture(32, 32, 0).save(tmp_path / "mixed" / "a" / "0.png")
    _picture(32, 32, 0).save(tmp_path / "mixed" / "x.png")
    with pytest.raises(ValueError, match="prompts.edit.folder: .* mixes image files and subfolders"):
        load_picture_sets(tmp_path / "mixed")
    (tmp_path / "odd" / "a").mkdir(parents=True)
    _picture(40, 32, 0).save(tmp_path / "odd" / "a" / "0.png")
    with pytest.raises(ValueError, match="a/0.png is 40×32 pixels.*vae_area"):
        load_picture_sets(tmp_path / "odd")
    assert [[n for n, _ in s] for s in load_picture_sets(tmp_path / "odd", vae_area=1280)] == [["a/0.png"]]
    with pytest.raises(ValueError, match="vae_area=100 must be at least 256"):
        load_picture_sets(tmp_path / "odd", vae_area=100)

"""The full chain on the tiny random pipeline: prompt text → encode → rollout/recompute/compare → VAE images."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image

from mmdit_strict.cli.main import main
from mmdit_strict.pipelines.encode import read_prompt_metadata
from mmdit_strict.pipelines.vae import decode_rollout

TEXTS = ["a red cat on a mat", "a lighthouse at dusk"]


def test_run_with_a_pipeline_folder(tiny_pipeline_dir, tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["run", f"model.checkpoint={tiny_pipeline_dir}", f"prompts.text=[{', '.join(TEXTS)}]", "--quiet",
               "sampler.height=32", "sampler.width=48", "sampler.num_steps=2", f"output_dir={out}", "wandb.mode=disabled"])
    assert rc == 0, capsys.readouterr()
    meta = read_prompt_metadata(out / "prompts.safetensors")
    assert meta["prompts"] == TEXTS and meta["negative_prompt"] == " "
    images = sorted((out / "images").glob("sample_*.png"))
    assert len(images) == len(TEXTS)
    assert np.asarray(Image.open(images[0])).shape == (32, 48, 3)
    info = json.loads((out / "images" / "decode.json").read_text())
    assert info["mode"] == "vae"
    times = json.loads((out / "images" / "timings.json").read_text())
    assert {"text_encoder_seconds", "rollout_seconds", "recompute_seconds", "vae_seconds"} <= set(times)
    report = (out / "report" / "report.md").read_text()
    assert report.count("## Images") == 1 and "![contact sheet](contact_sheet.png)" in report
    assert (out / "report" / "contact_sheet.png").is_file()
    assert main(["report", str(out)]) == 0  # the rebuilt report keeps the images section
    assert (out / "report" / "report.md").read_text().count("## Images") == 1
    # the preview path on the same rollout (no VAE): fixed, one pixel per latent cell
    prev = decode_rollout(out / "rollout", tmp_path / "preview", None)
    assert prev["mode"] == "preview" and prev["image_shape"] == [4, 6, 3]


def test_prompts_text_needs_a_pipeline_folder(tmp_path, capsys):
    rc = main(["run", "prompts.text=[a cat]", f"output_dir={tmp_path / 'r'}", "wandb.mode=disabled", "--quiet"])
    assert rc == 2 and "needs model.checkpoint=<a Qwen-Image pipeline folder>" in capsys.readouterr().err

"""Input pictures → conditioning latents (prompts.edit.source=folder): clear errors for bad folders and
sizes; the edit pipeline's normalization (division by std) on the tiny VAE."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmdit_strict.pipelines.edit_inputs import encode_picture, load_pictures
from mmdit_strict.pipelines.tiny import tiny_vae
from mmdit_strict.sampling.latents import pack_latents


def test_bad_folders_and_sizes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a folder"):
        load_pictures(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no input image"):
        load_pictures(tmp_path / "empty")
    (tmp_path / "odd").mkdir()
    Image.fromarray(np.zeros((40, 32, 3), np.uint8)).save(tmp_path / "odd" / "a.png")
    with pytest.raises(ValueError, match=r"a.png is 32×40 pixels: both sides must be multiples of 16"):
        load_pictures(tmp_path / "odd")


def test_encode_picture_divides_by_std_as_the_edit_pipeline() -> None:
    vae = tiny_vae(1)
    pic = np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8)
    got = encode_picture(vae, pic)
    assert got.grid == (2, 3) and tuple(got.latents.shape) == (6, 64)
    x = torch.from_numpy(pic).permute(2, 0, 1)[None].float() / 255.0 * 2 - 1
    with torch.no_grad():
        z = vae.encode(x.unsqueeze(2)).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    expected = pack_latents(((z - mean) / std)[:, :, 0])[0]
    assert torch.equal(got.latents, expected)

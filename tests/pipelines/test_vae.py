"""Final latents to images: byte parity with QwenImagePipeline's own decode, the preview, the contact sheet."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmdit_strict.pipelines.vae import contact_sheet, decode, load_vae, preview_rgb, unpack_latents

CALL = dict(prompt=["a red cat", "blue"], negative_prompt=" ", true_cfg_scale=4.0, height=32, width=48,
            num_inference_steps=2)


def test_decode_is_the_pipelines_pil_bytes(tiny_pipe, tiny_pipeline_dir):
    """Same packed latents: our decode gives the very uint8 pixels of the pipeline's output_type='pil'."""
    latents = tiny_pipe(generator=torch.Generator().manual_seed(1), output_type="latent", **CALL).images
    pil = tiny_pipe(generator=torch.Generator().manual_seed(1), output_type="pil", **CALL).images
    ours = decode(load_vae(tiny_pipeline_dir), latents, (32 // 16, 48 // 16))
    assert ours.shape == (2, 32, 48, 3) and ours.dtype == np.uint8
    for i, im in enumerate(pil):
        assert np.array_equal(np.asarray(im), ours[i]), f"sample {i}: decoded pixels differ from the pipeline's"


def test_unpack_layout_and_errors():
    packed = torch.arange(2 * 6 * 64, dtype=torch.float32).reshape(2, 6, 64)
    z = unpack_latents(packed, (2, 3))
    assert z.shape == (2, 16, 1, 4, 6)
    # token (row 1, col 2) holds channel c of its 2x2 patch at 4c + 2dy + dx
    assert z[0, 5, 0, 2 + 1, 4 + 0] == packed[0, 1 * 3 + 2, 5 * 4 + 2 * 1 + 0]
    from diffusers import QwenImagePipeline

    assert torch.equal(z, QwenImagePipeline._unpack_latents(packed, 32, 48, 8)), "unpack order differs from diffusers'"
    with pytest.raises(ValueError, match=r"expected packed latents of shape \(B, 4, 64\)"):
        unpack_latents(packed, (2, 2))


def test_preview_is_fixed_and_sheet_tiles():
    packed = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(0))
    a, b = preview_rgb(packed, (2, 2)), preview_rgb(packed.clone(), (2, 2))
    assert a.shape == (3, 4, 4, 3) and a.dtype == np.uint8 and np.array_equal(a, b)
    sheet = contact_sheet(list(a), cols=2, pad=2, min_cell=8)
    assert sheet.shape == (2 * (8 + 2) + 2, 2 * (8 + 2) + 2, 3)
    assert np.array_equal(sheet[2:10, 2:10], a[0].repeat(2, 0).repeat(2, 1))
    assert (sheet[12:20, 12:20] == 255).all()  # 3 images on a 2x2 sheet: last cell blank
    with pytest.raises(ValueError, match="at least one image"):
        contact_sheet([])

"""Images to packed latents: byte parity with diffusers' own encode path, the round trip through both
decodes, and the input errors."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mmdit_strict.pipelines.vae import decode, load_vae
from mmdit_strict.pipelines.vae_encode import encode

H, W = 32, 48
GRID = (H // 16, W // 16)


def _images(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(2, H, W, 3), dtype=np.uint8)


@pytest.fixture()
def img2img(tiny_pipeline_dir):
    """diffusers' QwenImageImg2ImgPipeline on the tiny folder (the img2img encode path we follow)."""
    from diffusers import QwenImageImg2ImgPipeline

    return QwenImageImg2ImgPipeline.from_pretrained(str(tiny_pipeline_dir))


def _theirs(pipe, pixels: torch.Tensor, *, argmax: bool, generator=None) -> torch.Tensor:
    """diffusers' packed image latents: ``_encode_vae_image`` then ``_pack_latents``.

    ``argmax``: the latents are retrieved with diffusers' ``retrieve_latents(..., sample_mode="argmax")``
    (the edit pipelines' retrieval) and handed to the img2img ``_encode_vae_image`` as a plain
    ``latents`` output, so its own normalization code runs on them.
    """
    from diffusers import QwenImageImg2ImgPipeline
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import retrieve_latents

    x = pixels.unsqueeze(2).to(pipe.vae.dtype)  # prepare_latents: [B, C, H, W] → [B, C, 1, H, W]
    if argmax:
        vae = pipe.vae
        mode_vae = SimpleNamespace(config=vae.config, encode=lambda t: SimpleNamespace(
            latents=retrieve_latents(vae.encode(t), sample_mode="argmax")))
        z = QwenImageImg2ImgPipeline._encode_vae_image(SimpleNamespace(vae=mode_vae), x, None)
    else:
        z = pipe._encode_vae_image(x, generator)
    b, c, _, h, w = z.shape
    return QwenImageImg2ImgPipeline._pack_latents(z, b, c, h, w)


@torch.no_grad()
def test_sample_mode_is_img2imgs_bytes(img2img):
    """uint8 images, one draw from a keyed generator: the img2img pipeline's own preprocess + encode + pack."""
    from PIL import Image

    imgs = _images()
    pixels = img2img.image_processor.preprocess([Image.fromarray(im) for im in imgs])
    theirs = _theirs(img2img, pixels, argmax=False, generator=torch.Generator().manual_seed(7))
    ours = encode(img2img.vae, imgs, sample_mode="sample", generator=torch.Generator().manual_seed(7))
    assert ours.shape == (2, GRID[0] * GRID[1], 64) and ours.dtype == torch.float32
    assert torch.equal(ours, theirs), "sample-mode latents differ from diffusers' img2img encode"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_argmax_is_diffusers_bytes(img2img, dtype):
    """float images in [0, 1], the posterior's mode: diffusers' argmax retrieval and img2img
    normalization; FP32 runs our strict operator, BF16 the production arithmetic."""
    img2img.vae.to(dtype)
    pixels01 = torch.rand(2, 3, H, W, generator=torch.Generator().manual_seed(3))
    theirs = _theirs(img2img, img2img.image_processor.preprocess(pixels01), argmax=True)
    ours = encode(img2img.vae, pixels01)
    assert ours.dtype == dtype and ours.shape == (2, GRID[0] * GRID[1], 64)
    assert torch.equal(ours, theirs), f"argmax latents differ from diffusers' ({dtype})"
    assert torch.equal(encode(img2img.vae, pixels01), ours), "argmax encode is not repeatable"


@torch.no_grad()
def test_round_trip_is_diffusers_round_trip(img2img, tiny_pipe, tiny_pipeline_dir):
    """decode(encode(img)) gives the pixels QwenImagePipeline decodes from diffusers' own encode of img.

    The pipeline decodes the latents its step callback hands back, so its own unpack, denormalize,
    VAE decode and PIL conversion run on diffusers' encoded latents.
    """
    from PIL import Image

    imgs = _images(1)
    theirs_latents = _theirs(img2img, img2img.image_processor.preprocess([Image.fromarray(im) for im in imgs]),
                             argmax=True)

    def swap(pipe, i, t, kw):
        return {"latents": theirs_latents}

    pil = tiny_pipe(prompt=["a", "b"], height=H, width=W, num_inference_steps=2, output_type="pil",
                    generator=torch.Generator().manual_seed(0), callback_on_step_end=swap).images
    vae = load_vae(tiny_pipeline_dir)
    packed = encode(vae, imgs)
    assert torch.equal(packed, theirs_latents), "encoded latents differ from diffusers'"
    ours = decode(vae, packed, GRID)
    assert ours.shape == (2, H, W, 3) and ours.dtype == np.uint8
    for i, im in enumerate(pil):
        assert np.array_equal(np.asarray(im), ours[i]), f"sample {i}: round-trip pixels differ from diffusers'"


@pytest.mark.parametrize("images, kwargs, match", [
    (np.zeros((2, 3, H, W), np.uint8), {}, r"uint8 images must have shape \(B, H, W, 3\)"),
    (torch.zeros(2, H, W, 3), {}, r"float images must have shape \(B, 3, H, W\)"),
    (torch.zeros(H, W, 3, dtype=torch.uint8), {}, r"\(B, H, W, 3\)"),
    (torch.zeros(2, 3, H, W, dtype=torch.int32), {}, "got torch.int32"),
    (torch.full((1, 3, H, W), -0.5), {}, r"must lie in \[0, 1\]"),
    (torch.full((1, 3, H, W), 255.0), {}, r"must lie in \[0, 1\]"),
    (torch.full((1, 3, H, W), float("nan")), {}, "NaN or Inf"),
    (np.zeros((1, 24, W, 3), np.uint8), {}, "multiples of 16.*H=24 W=48"),
    (np.zeros((1, 8, 8, 3), np.uint8), {}, "multiples of 16"),
    (np.zeros((0, H, W, 3), np.uint8), {}, "B = 0"),
    (np.zeros((1, H, W, 3), np.uint8), {"sample_mode": "mean"}, "sample_mode must be one of"),
    (np.zeros((1, H, W, 3), np.uint8), {"sample_mode": "sample"}, "needs a torch.Generator"),
    (np.zeros((1, H, W, 3), np.uint8), {"generator": torch.Generator()}, "takes no generator"),
])
def test_bad_inputs_are_refused(tiny_pipeline_dir, images, kwargs, match):
    with pytest.raises(ValueError, match=match):
        encode(load_vae(tiny_pipeline_dir), images, **kwargs)


def test_non_array_is_refused(tiny_pipeline_dir):
    with pytest.raises(TypeError, match="torch.Tensor or numpy array"):
        encode(load_vae(tiny_pipeline_dir), [[0.0]])

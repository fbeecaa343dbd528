"""Inside diffusers: its own QwenImageEditPipeline and QwenImageEditPlusPipeline, with our strict transformer put
in place of theirs (use_mmdit), give their own transformer's latents within the drop-in tolerance — the input
image's latents appended as a second grid, the image-conditioned prompt and negative, CFG, all diffusers' code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmdit_strict.tolerances import tolerance


def _picture(w: int, h: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _pipeline(cls_name: str, folder):
    import diffusers
    from transformers.utils import is_torchvision_available

    from mmdit_strict.pipelines.encode_edit import load_edit_components

    extra = {} if is_torchvision_available() else {"processor": load_edit_components(folder)[0]}
    pipe = getattr(diffusers, cls_name).from_pretrained(str(folder), **extra)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.slow
@pytest.mark.parametrize("cls_name, images", [
    ("QwenImageEditPipeline", 1),
    # two 1024²-area VAE encodes on the CPU (about 30 s): its conditioning layout has a fast test in tests/model
    pytest.param("QwenImageEditPlusPipeline", 2, marks=pytest.mark.extended),
])
def test_diffusers_edit_pipelines_with_our_transformer_match_their_own(cls_name, images, tiny_edit_pipeline_dir,
                                                                        tiny_plus_pipeline_dir):
    from mmdit_strict.model.mmdit import MMDiT
    from mmdit_strict.pipelines.diffusers_adapter import use_mmdit

    pipe = _pipeline(cls_name, tiny_plus_pipeline_dir if images == 2 else tiny_edit_pipeline_dir)
    pics = [_picture(64, 48, 0), _picture(32, 32, 1)][:images]
    kw = dict(image=pics if images == 2 else pics[0], prompt="make it red", negative_prompt="blurry", true_cfg_scale=4.0,
              height=32, width=48, num_inference_steps=2, output_type="latent")
    theirs = pipe(generator=torch.Generator().manual_seed(0), **kw).images
    use_mmdit(pipe, runtime="strict")
    assert isinstance(pipe.transformer, MMDiT)
    ours = pipe(generator=torch.Generator().manual_seed(0), **kw).images
    assert ours.shape == theirs.shape
    ok, max_abs, _ = tolerance("pipelines", "dropin_latents_vs_diffusers", "fp32").check(ours.float(), theirs.float())
    assert ok, f"{cls_name}: max abs {max_abs:.3e}"
    assert not torch.equal(ours, torch.zeros_like(ours))

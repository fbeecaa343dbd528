"""Image-conditioned prompt encoding: the tiny edit folder, byte parity with diffusers' QwenImageEditPipeline."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmdit_strict.pipelines.encode_edit import (
    EDIT_DROP_TOKENS, EDIT_PROMPT_TEMPLATE, condition_image, encode_edit_prompts, load_edit_components,
)
from tests.harness import assert_bytes_equal

PROMPTS = ["make the cat red", "add a hat"]


def _picture(w: int, h: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def parts(tiny_edit_pipeline_dir):
    return load_edit_components(tiny_edit_pipeline_dir)


@pytest.fixture(scope="module")
def edit_pipe(tiny_edit_pipeline_dir, parts):
    """diffusers' QwenImageEditPipeline from the tiny folder (the processor passed in without torchvision,
    which transformers 5 needs to load Qwen2VLProcessor itself)."""
    from diffusers import QwenImageEditPipeline
    from transformers.utils import is_torchvision_available

    extra = {} if is_torchvision_available() else {"processor": parts[0]}
    return QwenImageEditPipeline.from_pretrained(str(tiny_edit_pipeline_dir), **extra)


def test_edit_folder_keeps_tiny_bytes_and_token_ids(tiny_pipeline_dir, tiny_edit_pipeline_dir, parts):
    import json

    for sub in ("text_encoder/model.safetensors", "transformer/diffusion_pytorch_model.safetensors",
                "vae/diffusion_pytorch_model.safetensors"):
        assert (tiny_pipeline_dir / sub).read_bytes() == (tiny_edit_pipeline_dir / sub).read_bytes(), sub
    from transformers import AutoTokenizer

    old = AutoTokenizer.from_pretrained(str(tiny_pipeline_dir / "tokenizer"))
    new = parts[0].tokenizer
    text = "<|im_start|>user\nmake it red<|im_end|>"
    assert old(text).input_ids == new(text).input_ids
    cfg = json.loads((tiny_edit_pipeline_dir / "text_encoder" / "config.json").read_text())
    ids = new.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    assert ids == [cfg["image_token_id"], cfg["video_token_id"], cfg["vision_start_token_id"], cfg["vision_end_token_id"]]
    assert ids[0] == len(old)


def test_condition_image_is_diffusers_resize(edit_pipe):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    img = _picture(96, 64, 0)
    w, h, _ = calculate_dimensions(1024 * 1024, 96 / 64)
    ours = condition_image(img)
    assert ours.size == (w, h)
    assert np.array_equal(np.asarray(ours), np.asarray(edit_pipe.image_processor.resize(img, h, w)))


def test_edit_prompts_are_diffusers_bytes(edit_pipe, parts):
    assert edit_pipe.prompt_template_encode == EDIT_PROMPT_TEMPLATE
    assert edit_pipe.prompt_template_encode_start_idx == EDIT_DROP_TOKENS
    processor, encoder = parts
    images = [_picture(96, 64, 0), _picture(48, 80, 1)]
    ours = encode_edit_prompts(processor, encoder, PROMPTS, images, negative_prompt=None)
    for i, (p, im) in enumerate(zip(PROMPTS, images)):
        ref, ref_mask = edit_pipe.encode_prompt(p, condition_image(im), device="cpu")
        assert ref_mask is None  # one prompt: all rows valid
        n = int(ours.prompt_mask[i].sum())
        assert n == ref.shape[1]
        assert_bytes_equal(ours.prompt_embeds[i, :n], ref[0], f"edit prompt {i} vs diffusers")
        assert torch.count_nonzero(ours.prompt_embeds[i, n:]) == 0
    batched = encode_edit_prompts(processor, encoder, PROMPTS, images, negative_prompt=None, batch_size=2)
    ref, ref_mask = edit_pipe.encode_prompt(PROMPTS, [condition_image(im) for im in images], device="cpu")
    assert_bytes_equal(batched.prompt_embeds, ref, "batched edit prompts vs diffusers")
    assert_bytes_equal(batched.prompt_mask, ref_mask, "batched edit mask vs diffusers")


def test_image_changes_the_embedding(parts):
    processor, encoder = parts
    a = encode_edit_prompts(processor, encoder, PROMPTS[:1], [_picture(64, 64, 0)], negative_prompt=" ", condition_area=None)
    b = encode_edit_prompts(processor, encoder, PROMPTS[:1], [_picture(64, 64, 2)], negative_prompt=" ", condition_area=None)
    assert a.prompt_embeds.shape == b.prompt_embeds.shape and not torch.equal(a.prompt_embeds, b.prompt_embeds)
    assert not torch.equal(a.negative_embeds, b.negative_embeds)  # each negative is encoded with its prompt's image
    c, d = (encode_edit_prompts(processor, encoder, PROMPTS[:1], [_picture(64, 64, s)], negative_prompt=" ",
                                condition_area=None, negative_with_images=False) for s in (0, 2))
    assert c.negative_mask is None and c.negative_embeds.dim() == 2
    assert_bytes_equal(c.negative_embeds, d.negative_embeds, "the text-only negative does not see the image")


def test_per_image_negatives_are_diffusers_bytes(edit_pipe, parts):
    """The negative of prompt i, encoded with prompt i's image: diffusers' encode_prompt(negative, image)."""
    images = [_picture(96, 64, 0), _picture(48, 80, 1)]
    ours = encode_edit_prompts(*parts, PROMPTS, images, negative_prompt="blurry")
    assert ours.negative_embeds.dim() == 3 and ours.negative_mask.shape == ours.negative_embeds.shape[:2]
    for i, im in enumerate(images):
        ref, _ = edit_pipe.encode_prompt("blurry", condition_image(im), device="cpu")
        n = int(ours.negative_mask[i].sum())
        assert_bytes_equal(ours.negative_embeds[i, :n], ref[0], f"negative of prompt {i} vs diffusers")


def test_edit_encode_errors(parts):
    processor, encoder = parts
    img = _picture(64, 64, 0)
    with pytest.raises(ValueError, match="one image per prompt"):
        encode_edit_prompts(processor, encoder, PROMPTS, [img])
    with pytest.raises(ValueError, match="has no image"):
        encode_edit_prompts(processor, encoder, PROMPTS, [img, None])
    with pytest.raises(ValueError, match="vision token"):
        encode_edit_prompts(processor, encoder, ["a <|image_pad|> b"], [img])
    with pytest.raises(FileNotFoundError, match="processor/"):
        from mmdit_strict.pipelines.tiny_edit import load_processor

        load_processor(processor.tokenizer.name_or_path + "/nowhere")


def test_cli_encode_with_images(tiny_edit_pipeline_dir, parts, tmp_path, capsys):
    from omegaconf import OmegaConf

    from mmdit_strict.cli.main import main
    from mmdit_strict.config.arch import preset
    from mmdit_strict.pipelines.encode import read_prompt_metadata
    from mmdit_strict.trajectories.setup import make_prompts

    imgs = tmp_path / "imgs"
    imgs.mkdir()
    pictures = [_picture(96, 64, 0), _picture(48, 80, 1)]
    for i, im in enumerate(pictures):
        im.save(imgs / f"{i}.png")
    out = tmp_path / "p.safetensors"
    args = ["encode", str(tiny_edit_pipeline_dir), *sum((["--prompt", p] for p in PROMPTS), []), "--images", str(imgs),
            "--out", str(out), "--condition-area", "0"]
    assert main(args) == 0
    meta = read_prompt_metadata(out)
    assert meta["template"] == EDIT_PROMPT_TEMPLATE and meta["drop_tokens"] == str(EDIT_DROP_TOKENS)
    assert meta["images"] == '["0.png", "1.png"]' and meta["condition_area"] == "none"
    processor, encoder = parts
    ref = encode_edit_prompts(processor, encoder, PROMPTS, pictures, condition_area=None)
    prompts = make_prompts(OmegaConf.create({"embeddings": str(out)}), preset("tiny"), "cpu", "float32")
    for i, e in enumerate(prompts.embeds):
        assert_bytes_equal(e, ref.prompt_embeds[i, : int(ref.prompt_mask[i].sum())], f"file prompt {i}")
    assert prompts.negatives is not None and len(prompts.negatives) == 2
    for i, e in enumerate(prompts.negatives):
        assert_bytes_equal(e, ref.negative_embeds[i, : int(ref.negative_mask[i].sum())], f"file negative {i}")
    assert_bytes_equal(prompts.negative, prompts.negatives[0], "the shared slot holds prompt 0's negative")
    assert main(["encode", str(tiny_edit_pipeline_dir), "--prompt", "x", "--images", str(imgs), "--out", str(tmp_path / "q")]) == 2
    assert "1 prompts and 2 image sets" in capsys.readouterr().err


def test_main_job_encodes_each_prompt_with_its_picture(tiny_pipeline_dir, tiny_edit_pipeline_dir, parts, tmp_path):
    """prompts.text + prompts.edit.source=folder: prompt i is encoded with picture i mod n (the one whose
    latents condition sample i); a text-to-image folder (no processor/) keeps text-only prompts."""
    from omegaconf import OmegaConf

    from mmdit_strict.pipelines.chain import prepare_prompts
    from mmdit_strict.pipelines.encode import read_prompt_metadata
    from safetensors.torch import load_file

    imgs = tmp_path / "imgs"
    imgs.mkdir()
    pictures = [_picture(48, 32, 3), _picture(32, 32, 4)]
    for name, im in zip(("a.png", "b.png"), pictures):
        im.save(imgs / name)
    texts = ["make it red", "add a hat", "turn it blue"]

    def cfg(folder, out):
        return OmegaConf.create({"model": {"checkpoint": str(folder), "dtype": "float32", "device": "cpu"},
                                 "output_dir": str(out), "prompts": {"text": texts, "embeddings": None, "negative": " ",
                                                                     "edit": {"source": "folder", "folder": str(imgs)}}})

    new_cfg, _ = prepare_prompts(cfg(tiny_edit_pipeline_dir, tmp_path / "run"))
    meta = read_prompt_metadata(new_cfg.prompts.embeddings)
    assert meta["images"] == '["a.png", "b.png", "a.png"]' and meta["template"] == EDIT_PROMPT_TEMPLATE
    processor, encoder = parts
    ref = encode_edit_prompts(processor, encoder, texts, [pictures[0], pictures[1], pictures[0]])
    data = load_file(new_cfg.prompts.embeddings)
    assert_bytes_equal(data["prompt_embeds"], ref.prompt_embeds, "main job's edit prompts")
    assert_bytes_equal(data["negative_embeds"], ref.negative_embeds, "main job's negative")
    from mmdit_strict.pipelines.encode import PROMPT_TEMPLATE

    text_only, _ = prepare_prompts(cfg(tiny_pipeline_dir, tmp_path / "run2"))
    meta = read_prompt_metadata(text_only.prompts.embeddings)
    assert meta["template"] == PROMPT_TEMPLATE and "images" not in meta

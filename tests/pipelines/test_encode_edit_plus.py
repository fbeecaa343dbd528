"""Several input images per prompt (Qwen-Image-Edit-Plus): byte parity with diffusers'
QwenImageEditPlusPipeline.encode_prompt on the tiny random Plus folder, prompt and negative (each encoded
with the prompt's own images); the images-folder layouts and their errors; the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from mmdit_strict.pipelines.edit_images import is_plus_folder, load_image_sets
from mmdit_strict.pipelines.encode_edit import EDIT_DROP_TOKENS, condition_image, load_edit_components
from mmdit_strict.pipelines.encode_edit_plus import PLUS_CONDITION_AREA, PLUS_PROMPT_TEMPLATE, encode_plus_prompts
from tests.harness import assert_bytes_equal
from tests.pipelines.test_encode_edit import _picture

PROMPTS = ["put the hat of picture 2 on the cat of picture 1", "make it red"]


@pytest.fixture(scope="module")
def parts(tiny_plus_pipeline_dir):
    return load_edit_components(tiny_plus_pipeline_dir)


@pytest.fixture(scope="module")
def plus_pipe(tiny_plus_pipeline_dir, parts):
    from diffusers import QwenImageEditPlusPipeline
    from transformers.utils import is_torchvision_available

    extra = {} if is_torchvision_available() else {"processor": parts[0]}
    return QwenImageEditPlusPipeline.from_pretrained(str(tiny_plus_pipeline_dir), **extra)


def _valid(e: torch.Tensor, m: torch.Tensor, i: int) -> torch.Tensor:
    return e[i, : int(m[i].sum())]


def test_plus_prompts_and_negatives_are_diffusers_bytes(plus_pipe, parts, tiny_plus_pipeline_dir):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions

    assert is_plus_folder(tiny_plus_pipeline_dir)
    assert plus_pipe.prompt_template_encode == PLUS_PROMPT_TEMPLATE and plus_pipe.prompt_template_encode_start_idx == EDIT_DROP_TOKENS
    assert CONDITION_IMAGE_SIZE == PLUS_CONDITION_AREA
    sets = [[_picture(96, 64, 0), _picture(48, 80, 1)], [_picture(64, 64, 2)]]
    ours = encode_plus_prompts(*parts, PROMPTS, sets, negative_prompt=" ")
    assert ours.negative_embeds.dim() == 3 and ours.negative_mask is not None
    for i, (p, s) in enumerate(zip(PROMPTS, sets)):
        resized = []
        for im in s:  # what the Plus pipeline hands its encode_prompt
            w, h = calculate_dimensions(CONDITION_IMAGE_SIZE, im.size[0] / im.size[1])
            resized.append(plus_pipe.image_processor.resize(im, h, w))
        assert [r.size for r in resized] == [condition_image(im, PLUS_CONDITION_AREA).size for im in s]
        ref, ref_mask = plus_pipe.encode_prompt(p, image=resized, device="cpu")
        assert ref_mask is None
        assert_bytes_equal(_valid(ours.prompt_embeds, ours.prompt_mask, i), ref[0], f"Plus prompt {i} vs diffusers")
        neg, _ = plus_pipe.encode_prompt(" ", image=resized, device="cpu")
        assert_bytes_equal(_valid(ours.negative_embeds, ours.negative_mask, i), neg[0], f"Plus negative {i} vs diffusers")
    assert not torch.equal(ours.negative_mask[0], ours.negative_mask[1])  # each negative saw its own images
    batched = encode_plus_prompts(*parts, PROMPTS, sets, negative_prompt=None, batch_size=2)  # prompts of a batch, own images each
    assert torch.equal(batched.prompt_mask.sum(1), ours.prompt_mask.sum(1))
    assert batched.negative_embeds is None and tuple(batched.prompt_mask.shape)[0] == 2
    text_only = encode_plus_prompts(*parts, PROMPTS[:1], sets[:1], negative_with_images=False)
    assert text_only.negative_embeds.dim() == 2 and text_only.negative_mask is None


def test_plus_encode_errors(parts):
    img = _picture(64, 64, 0)
    with pytest.raises(ValueError, match="one list of images per prompt"):
        encode_plus_prompts(*parts, PROMPTS, [[img]])
    with pytest.raises(ValueError, match="prompt 1 needs a non-empty list of images"):
        encode_plus_prompts(*parts, PROMPTS, [[img], []])
    with pytest.raises(ValueError, match="missing image"):
        encode_plus_prompts(*parts, PROMPTS, [[img], [img, None]])
    with pytest.raises(ValueError, match="vision token"):
        encode_plus_prompts(*parts, ["Picture 1: <|vision_start|>"], [[img]])


def test_image_folder_layouts(tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    for n in ("b.png", "a.png"):
        _picture(32, 32, 0).save(flat / n)
    assert [names for names, _ in load_image_sets(flat)] == [["a.png"], ["b.png"]]
    per = tmp_path / "per"
    for sub, names in (("01", ["x.png"]), ("00", ["b.png", "a.png"])):
        (per / sub).mkdir(parents=True)
        for n in names:
            _picture(32, 48, 1).save(per / sub / n)
    sets = load_image_sets(per)
    assert [names for names, _ in sets] == [["00/a.png", "00/b.png"], ["01/x.png"]] and sets[0][1][0].size == (32, 48)
    (per / "stray.png").write_bytes((per / "01" / "x.png").read_bytes())
    with pytest.raises(ValueError, match="mixes image files and subfolders"):
        load_image_sets(per)
    (tmp_path / "e" / "00").mkdir(parents=True)
    with pytest.raises(ValueError, match="subfolder 00 holds no image"):
        load_image_sets(tmp_path / "e")
    with pytest.raises(ValueError, match="is not a folder"):
        load_image_sets(tmp_path / "missing")


def test_cli_encode_with_a_subfolder_per_prompt(tiny_plus_pipeline_dir, tiny_edit_pipeline_dir, parts, tmp_path, capsys):
    from mmdit_strict.cli.main import main
    from mmdit_strict.pipelines.encode import read_prompt_metadata
    from safetensors.torch import load_file

    sets = [[_picture(96, 64, 0), _picture(48, 80, 1)], [_picture(64, 64, 2)]]
    for i, s in enumerate(sets):
        (tmp_path / "imgs" / f"p{i}").mkdir(parents=True)
        for k, im in enumerate(s):
            im.save(tmp_path / "imgs" / f"p{i}" / f"{k}.png")
    out = tmp_path / "p.safetensors"
    prompts = sum((["--prompt", p] for p in PROMPTS), [])
    assert main(["encode", str(tiny_plus_pipeline_dir), *prompts, "--images", str(tmp_path / "imgs"), "--out", str(out)]) == 0
    meta = read_prompt_metadata(out)
    assert meta["template"] == PLUS_PROMPT_TEMPLATE and json.loads(meta["images"]) == [["p0/0.png", "p0/1.png"], ["p1/0.png"]]
    assert meta["condition_area"] == str(PLUS_CONDITION_AREA) and "own images" in meta["negative_conditioning"]
    ref = encode_plus_prompts(*parts, PROMPTS, sets)
    data = load_file(str(out))
    for key, want in (("prompt_embeds", ref.prompt_embeds), ("prompt_mask", ref.prompt_mask),
                      ("negative_embeds", ref.negative_embeds), ("negative_mask", ref.negative_mask)):
        assert_bytes_equal(data[key], want, f"CLI {key}")
    # several images per prompt need a Plus folder; counts must match
    assert main(["encode", str(tiny_edit_pipeline_dir), *prompts, "--images", str(tmp_path / "imgs"), "--out", str(tmp_path / "q")]) == 2
    assert "QwenImageEditPlusPipeline" in capsys.readouterr().err
    assert main(["encode", str(tiny_plus_pipeline_dir), "--prompt", "x", "--images", str(tmp_path / "imgs"), "--out", str(tmp_path / "q")]) == 2
    assert "1 prompts and 2 image sets" in capsys.readouterr().err

"""Prompt encoding: byte parity with diffusers' QwenImagePipeline.encode_prompt on the tiny encoder, the file format."""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.pipelines.encode import (
    DROP_TOKENS, FILE_FORMAT, PROMPT_TEMPLATE, encode_prompts, load_text_components, read_prompt_metadata, template_sha256,
    write_prompt_file,
)
from tests.harness import assert_bytes_equal

PROMPTS = ["a red cat on a mat", "blue", "a very long prompt about a lighthouse at dusk, waves, gulls and fog"]


@pytest.fixture(scope="module")
def text_parts(tiny_pipeline_dir):
    return load_text_components(tiny_pipeline_dir)


def _diffusers(tiny_pipe, prompts):
    embeds, mask = tiny_pipe.encode_prompt(prompts, device="cpu")
    return embeds, (torch.ones(embeds.shape[:2], dtype=torch.long) if mask is None else mask)


def test_batched_encoding_is_diffusers_bytes(tiny_pipe, text_parts):
    tok, enc = text_parts
    ours = encode_prompts(tok, enc, PROMPTS, negative_prompt=" ", batch_size=len(PROMPTS))
    embeds, mask = _diffusers(tiny_pipe, PROMPTS)
    assert_bytes_equal(ours.prompt_embeds, embeds, "batched prompt_embeds vs diffusers")
    assert_bytes_equal(ours.prompt_mask, mask, "batched prompt_mask vs diffusers")
    neg, _ = _diffusers(tiny_pipe, [" "])
    assert_bytes_equal(ours.negative_embeds, neg[0], "negative prompt vs diffusers")


def test_one_prompt_per_batch_is_diffusers_bytes_per_prompt(tiny_pipe, text_parts):
    """batch_size=1 (the default): each prompt's valid rows equal diffusers' encoding of that prompt alone."""
    tok, enc = text_parts
    ours = encode_prompts(tok, enc, PROMPTS, negative_prompt=None)
    assert ours.negative_embeds is None
    for i, p in enumerate(PROMPTS):
        embeds, _ = _diffusers(tiny_pipe, [p])
        n = int(ours.prompt_mask[i].sum())
        assert n == embeds.shape[1] == len(tok(PROMPT_TEMPLATE.format(p)).input_ids) - DROP_TOKENS
        assert_bytes_equal(ours.prompt_embeds[i, :n], embeds[0], f"prompt {i} alone vs diffusers")
        assert torch.count_nonzero(ours.prompt_embeds[i, n:]) == 0


def test_prompt_file_header_and_rollout_reads_it(tiny_pipeline_dir, text_parts, tmp_path):
    from omegaconf import OmegaConf

    from mmdit_strict.config.arch import preset
    from mmdit_strict.trajectories.setup import make_prompts

    tok, enc = text_parts
    encoded = encode_prompts(tok, enc, PROMPTS[:2], negative_prompt=" ")
    path = write_prompt_file(tmp_path / "p.safetensors", encoded, pipeline_folder=tiny_pipeline_dir, batch_size=1)
    again = write_prompt_file(tmp_path / "q.safetensors", encoded, pipeline_folder=tiny_pipeline_dir, batch_size=1)
    assert path.read_bytes() == again.read_bytes(), "two writes of the same prompts differ in bytes"
    meta = read_prompt_metadata(path)
    assert meta["format"] == FILE_FORMAT and meta["prompts"] == PROMPTS[:2] and meta["negative_prompt"] == " "
    assert meta["template_sha256"] == template_sha256() and meta["drop_tokens"] == "34"
    assert len(meta["tokenizer_sha256"]) == 64 and len(meta["text_encoder_sha256"]) == 64
    cfg = OmegaConf.create({"prompts": {"embeddings": str(path)}})
    prompts = make_prompts(cfg.prompts, preset("tiny"), "cpu", "float32")
    assert len(prompts.embeds) == 2
    for i, e in enumerate(prompts.embeds):
        assert_bytes_equal(e, encoded.prompt_embeds[i, : int(encoded.prompt_mask[i].sum())], f"rollout prompt {i}")
    assert_bytes_equal(prompts.negative, encoded.negative_embeds, "rollout negative prompt")


def test_encode_errors(text_parts, tmp_path):
    tok, enc = text_parts
    with pytest.raises(ValueError, match="non-empty list of strings"):
        encode_prompts(tok, enc, [])
    with pytest.raises(ValueError, match="batch_size"):
        encode_prompts(tok, enc, ["a"], batch_size=0)
    with pytest.raises(ValueError, match="max_sequence_length"):
        encode_prompts(tok, enc, ["a"], max_sequence_length=4096)
    with pytest.raises(FileNotFoundError, match="no tokenizer/ folder"):
        load_text_components(tmp_path)


def test_encode_command(tiny_pipeline_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    from mmdit_strict.cli.main import main

    (tmp_path / "prompts.txt").write_text("a red cat on a mat\n\nblue\n")
    out = tmp_path / "enc.safetensors"
    assert main(["encode", str(tiny_pipeline_dir), "--prompts-file", str(tmp_path / "prompts.txt"),
                 "--prompt", "third", "--out", str(out)]) == 0
    assert f"prompts.embeddings={out}" in capsys.readouterr().out
    assert read_prompt_metadata(out)["prompts"] == ["third", "a red cat on a mat", "blue"]  # --prompt first, then the file
    assert set(load_file(str(out))) == {"prompt_embeds", "prompt_mask", "negative_embeds"}
    assert main(["encode", str(tiny_pipeline_dir), "--out", str(out)]) == 2  # no prompts: a clear error
    assert "no prompts" in capsys.readouterr().err

"""The tiny random Qwen-Image pipeline folder shared by the pipeline tests (built once, offline)."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(scope="session")
def tiny_pipeline_dir(tmp_path_factory):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    from mmdit_strict.pipelines.tiny import save_tiny_pipeline

    return save_tiny_pipeline(tmp_path_factory.mktemp("pipe") / "tiny-qwen-image", seed=0)


@pytest.fixture()
def tiny_pipe(tiny_pipeline_dir):
    """A fresh diffusers QwenImagePipeline (its own transformer) loaded from the tiny folder."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(str(tiny_pipeline_dir))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def tiny_edit_pipeline_dir(tmp_path_factory):
    """The tiny Qwen-Image-Edit folder (the tiny folder plus vision tokens and processor/), built once."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from mmdit_strict.pipelines.tiny_edit import save_tiny_edit_pipeline

    return save_tiny_edit_pipeline(tmp_path_factory.mktemp("pipe") / "tiny-qwen-image-edit", seed=0)


@pytest.fixture(scope="session")
def tiny_plus_pipeline_dir(tmp_path_factory):
    """The tiny edit folder named a QwenImageEditPlusPipeline (several input images per prompt), built once."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from mmdit_strict.pipelines.tiny_edit import save_tiny_edit_pipeline

    return save_tiny_edit_pipeline(tmp_path_factory.mktemp("pipe") / "tiny-qwen-image-edit-plus", seed=0, plus=True)

"""Training from a pipeline folder: prompts.text encoded by its text encoder, image rewards on its VAE's decode."""

from __future__ import annotations

import logging

import pytest

from tests.training.conftest import compose_train
from mmdit_strict.training.loop import run_training
from tests.training.conftest import SMALL


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    from mmdit_strict.pipelines.tiny import save_tiny_pipeline

    return save_tiny_pipeline(tmp_path_factory.mktemp("pipe") / "tiny-qwen-image", seed=0)


@pytest.mark.slow
def test_vae_images_and_prompt_texts_reach_the_rewards(tmp_path, pipeline_dir) -> None:
    texts = ["a red cat", "a blue dog on a hill", "snow"]
    cfg = compose_train([f"output_dir={tmp_path}", *SMALL, f"model.checkpoint={pipeline_dir}", f"prompts.text=[{','.join(texts)}]",
                   "train.reward_fn={jpeg_compressibility: 1.0, 'tests.training.plugin_reward:prompt_length': 0.001}",
                   "train.num_epochs=1"])
    res = run_training(cfg, progress=False)
    row = res.metrics[0]
    assert row["images"] == "vae"
    picked = [texts[p] for p in row["prompt_ids"]]
    # 2 images per prompt: the plug-in's mean is the mean prompt length of the epoch's prompts
    assert row["reward/tests.training.plugin_reward:prompt_length_mean"] == pytest.approx(sum(map(len, picked)) / len(picked))
    assert row["reward/jpeg_compressibility_mean"] < 0
    assert row["first_update_ratio_exact_one_frac"] == 1.0

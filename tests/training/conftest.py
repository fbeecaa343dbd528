"""Training tests run single-threaded: the CI machine has 2 shared cores and tiny ops gain nothing from threads."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch
from omegaconf import DictConfig

from mmdit_strict.training.rewards import compose_train as train_config

# a small strict GRPO run: 2 prompts × 2 images, 3 steps → 12 (sample, step) pairs per epoch
SMALL = [
    "wandb.mode=disabled", "resume=false", "progress=false", "sampler.num_steps=3", "prompts.num_prompts=3",
    "sample.prompts_per_epoch=2", "sample.num_image_per_prompt=2", "sample.batch_size=4", "sample.cfg_layout=batched",
    "train.cfg_layout=sequential", "train.micro_batch=3", "train.gradient_accumulation_steps=4", "train.shuffle=true",
    "train.grad_checkpointing=false", "train.export=false", "+train.reward_fn.latent_stats=1.0",
    "train.learning_rate=0.05", "train.clip_range=0.2",
]


def compose_train(overrides: Sequence[str]) -> DictConfig:
    """The config `mmdit-strict train` composes from ``overrides``."""
    return train_config(overrides)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # module scope: active before the modules' own (module-scoped) training fixtures
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

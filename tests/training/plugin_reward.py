"""A reward plug-in for the registry tests (``tests.training.plugin_reward:brightness``)."""

from __future__ import annotations


def brightness(images, prompts, metadata):
    """Mean pixel value in [0, 1] per image."""
    return (images.float().mean(dim=(1, 2, 3)) / 255.0).tolist()


def latent_abs(latents, prompts, metadata, scale: float = 1.0):
    return (scale * latents.abs().flatten(1).mean(dim=1)).tolist()


latent_abs.takes = "latents"


def prompt_length(images, prompts, metadata):
    """The prompt's length in characters (checks that rewards see the prompt texts)."""
    return [float(len(p)) for p in prompts]

"""Sampling math for Qwen-Image Flow-GRPO: sigma schedule, CFG, SDE step + logp, latent layout, keyed noise.

Everything here is FP32 eager PyTorch built from correctly rounded elementwise ops and the fixed
reduction tree of :mod:`mmdit_strict.sampling.tree`, so the same inputs give the same bytes on the
CPU and on CUDA, at any batch size and batch position. It knows no model and no network.
"""

from .cfg import cfg_combine
from .latents import denormalize_latents, normalize_latents, pack_latents, unpack_latents
from .noise import initial_latents, noise_key, step_noise
from .sde import SDEStepResult, euler_step, gaussian_kl, sde_step
from .sigmas import mu_for, sigma_table
from .tree import tree_sum

__all__ = [
    "sigma_table",
    "mu_for",
    "cfg_combine",
    "sde_step",
    "euler_step",
    "SDEStepResult",
    "gaussian_kl",
    "normalize_latents",
    "denormalize_latents",
    "pack_latents",
    "unpack_latents",
    "noise_key",
    "initial_latents",
    "step_noise",
    "tree_sum",
]

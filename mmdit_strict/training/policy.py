"""The training side's view of the policy: log-probabilities of recorded (sample, step) pairs.

A micro-batch holds pairs from different denoising steps; one forward serves all of them, each
sample at its own sigma (the strict model is batch-invariant, so a row's bytes do not depend on what
it is batched with). Only what the config allows differs from the rollout: batch composition, CFG
layout, runtime, autograd. The SDE step then scores the recorded ``x_{t+1}`` (``prev_sample=``). Gradient
sample keys are ``((sample_id, step), cfg_branch)``, so the grad sink folds every pair's LoRA partial in
one global order whatever the split.

The reference policy for the KL term is the same model with the LoRA adapter disabled
(:func:`adapters_disabled`), run by the same operators.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..model import MMDiT
from ..sampling import sde_step
from ..trajectories.engine import velocity
from ..trajectories.setup import Prompts
from .rollout import EpochSamples


@dataclass
class PairEval:
    """Per-pair results, in the order of the pairs asked for.

    Attributes:
        logp: ``(P,)`` FP32 log-probability of the recorded transition (differentiable when grad is on).
        mean: ``(P, T, 64)`` FP32 transition mean.
        std: ``(P,)`` FP32 Flow-GRPO ``std_dev_t`` of each pair's step.
    """

    logp: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


def _adapter_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run the base model: every PEFT LoRA layer disabled inside the block, re-enabled (and trainable) after."""
    layers = _adapter_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapter: the KL reference (adapter disabled) needs lora.rank > 0")
    trainable = {id(p): p.requires_grad for p in model.parameters()}
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p in model.parameters():
            p.requires_grad_(trainable[id(p)])



def cfg_branches(cfg_scale: float) -> tuple[int, ...]:
    """The CFG branches a training forward runs: ``(0,)`` without CFG (scale 1), else ``(0, 1)`` (0 = conditional, 1 = negative)."""
    return (0,) if cfg_scale == 1.0 else (0, 1)


def pair_key(samples: EpochSamples, pair: tuple[int, int]) -> tuple[int, int]:
    """``(sample_id, step)`` of a ``(sample index, step)`` pair: the pair part of its gradient sample keys."""
    return samples.sample_ids[pair[0]], pair[1]


def grad_keys(samples: EpochSamples, pairs: Sequence[tuple[int, int]], cfg_scale: float) -> list[tuple[tuple[int, int], int]]:
    """The grad-sink sample keys ``((sample_id, step), branch)`` that evaluating ``pairs`` deposits under, branch-major."""
    return [(pair_key(samples, p), br) for br in cfg_branches(cfg_scale) for p in pairs]


def evaluate_pairs(
    model: MMDiT, samples: EpochSamples, pairs: Sequence[tuple[int, int]], prompts: Prompts, sigmas: torch.Tensor,
    grid: tuple[int, int], cfg_scale: float, cfg_layout: str, eta: float,
) -> PairEval:
    """Evaluate ``pairs`` = ``[(sample index n, step), ...]`` with the current policy and autograd mode.

    One forward (per CFG branch in the sequential layout) for the whole micro-batch, each pair at its
    own sigma; results in the order of ``pairs``.
    """
    if not pairs:
        raise ValueError("evaluate_pairs needs at least one (sample, step) pair")
    rows = [n for n, _ in pairs]
    steps = [s for _, s in pairs]
    x_t = torch.stack([samples.x[s, n] for n, s in pairs])
    x_next = torch.stack([samples.x[s + 1, n] for n, s in pairs])
    keys = [pair_key(samples, p) for p in pairs]
    sig = sigmas[steps].contiguous()
    sig_prev = sigmas[[s + 1 for s in steps]].contiguous()
    v = velocity(model, x_t.to(model.dtype), [prompts.embeds[samples.prompt_ids[n]] for n in rows],
                 prompts.negatives_of([samples.prompt_ids[n] for n in rows]),
                 sig.tolist(), grid, cfg_scale, cfg_layout, sample_ids=keys,
                 images=prompts.images_of([samples.prompt_ids[n] for n in rows]))
    res = sde_step(v, x_t, sig, sig_prev, prev_sample=x_next, eta=eta, sigma_max=float(sigmas[1]))
    return PairEval(res.logp, res.mean, res.std)

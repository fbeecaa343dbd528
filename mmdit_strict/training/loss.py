"""Flow-GRPO's clipped-ratio policy loss and KL term, per (sample, step) pair.

Per pair ``i`` (FP32):

    ratio_i   = exp(logp_i - old_logp_i)
    A_i       = clamp(advantage_i, -adv_clip_max, adv_clip_max)
    policy_i  = max(-A_i · ratio_i, -A_i · clamp(ratio_i, 1 - clip_range, 1 + clip_range))
    kl_i      = mean over elements of (mean_i - ref_mean_i)² / (2 std_i²)      (Flow-GRPO's convention)
    loss      = Σ_i weight · (policy_i + beta · kl_i)

``weight`` is ``1 / (pairs in this optimizer update)``, the same for every pair of the update: the
loss is the mean over the update like Flow-GRPO's accumulated per-micro-batch means, but a pair's
gradient does not depend on which micro-batch it landed in (a per-micro-batch mean would).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import gaussian_kl


@dataclass
class PairLoss:
    """The summed, weighted loss of a micro-batch and its per-pair diagnostics (detached)."""

    loss: torch.Tensor  # () FP32, differentiable
    ratio: torch.Tensor  # (P,)
    policy: torch.Tensor  # (P,)
    kl: torch.Tensor  # (P,) zeros when beta == 0
    clipped: torch.Tensor  # (P,) bool: |ratio - 1| > clip_range


def grpo_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, weight: float, clip_range: float,
    adv_clip_max: float, beta: float = 0.0, mean: torch.Tensor | None = None, ref_mean: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
) -> PairLoss:
    """Loss of ``P`` pairs; ``logp``/``old_logp``/``advantages`` are ``(P,)`` FP32; KL needs ``mean``, ``ref_mean``, ``std``."""
    for name, t in (("logp", logp), ("old_logp", old_logp), ("advantages", advantages)):
        if t.dim() != 1 or t.shape[0] != logp.shape[0] or t.dtype != torch.float32:
            raise ValueError(f"{name} must be ({logp.shape[0]},) float32, got {tuple(t.shape)} {t.dtype}")
    if clip_range < 0 or adv_clip_max <= 0:
        raise ValueError(f"need clip_range >= 0 and adv_clip_max > 0, got {clip_range}, {adv_clip_max}")
    adv = advantages.clamp(-adv_clip_max, adv_clip_max)
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    policy = torch.maximum(unclipped, clipped)
    per_pair = policy
    kl = torch.zeros_like(policy)
    if beta > 0:
        if mean is None or ref_mean is None or std is None:
            raise ValueError("beta > 0 needs the policy mean, the reference mean and std")
        kl = gaussian_kl(mean, ref_mean.detach(), std)
        per_pair = policy + beta * kl
    loss = (per_pair * weight).sum()
    return PairLoss(loss, ratio.detach(), policy.detach(), kl.detach(), ((ratio.detach() - 1.0).abs() > clip_range))


def logp_bytes_differ(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """``(P,)`` bool: pairs whose FP32 logp differs from the old logp in any byte.

    The honest on-policy test: ``ratio = exp(logp − old)`` is exactly 1.0 in FP32 whenever
    ``|logp − old| ≤ 2^-24`` (about 6e-8), so a ratio of 1.0 alone does not show equal bytes.
    """
    if logp.dtype != torch.float32 or old_logp.dtype != torch.float32 or logp.shape != old_logp.shape:
        raise ValueError(f"need two FP32 tensors of one shape, got {logp.dtype} {tuple(logp.shape)} and "
                         f"{old_logp.dtype} {tuple(old_logp.shape)}")
    return logp.detach().contiguous().view(torch.int32) != old_logp.detach().contiguous().view(torch.int32)

"""Flow-GRPO SDE transition with log-probability (operator ``flow_sde_step_logp``, forward + dlogp),
the deterministic Euler (ODE) step, and the same-std Gaussian KL used by drift reports.

Math (docs/design.md §2; ``sigma`` current, ``sigma_prev`` next entry of the table, ``dt = sigma_prev - sigma``):

    std    = sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * eta
    mean   = x * (1 + std^2 / (2 sigma) * dt) + v * (1 + std^2 (1 - sigma) / (2 sigma)) * dt
    x_prev = mean + std * sqrt(-dt) * noise
    logp   = mean over the non-batch elements of
             -(x_prev - mean)^2 / (2 (std sqrt(-dt))^2) - log(std sqrt(-dt)) - log(sqrt(2 pi))

Arithmetic (FP32; eager torch; every op below is one correctly rounded IEEE op, so the bytes do not
depend on the device):

* Per-sample scalars are computed on the CPU from FP32 ``sigma``/``sigma_prev``/``sigma_max``/``eta``
  (Python floats are rounded once to FP32) and then copied to the data's device:
  ``dt = sp - s``; ``std = sqrt(s / (1 - where(s == 1, smax, s))) * eta``
  (every ``sqrt`` is the correctly rounded ``tree.sqrt_rn``: ``torch.sqrt`` is not correctly rounded on all builds); ``std2 = std * std``;
  ``a = (std2 / (2 s)) * dt + 1``; ``c = (std2 * (1 - s)) / (2 s) + 1``; ``ns = std * sqrt(-dt)``;
  ``var2 = 2 * (ns * ns)``; ``log_ns = fp32(math.log(ns))`` (float64 libm log of the FP32 value,
  rounded once: the only transcendental, done per value so it is independent of the batch);
  ``LOG_SQRT_2PI = fp32(0.5 * math.log(2 pi))``.
* Elementwise on the device, in this order: ``mean = x * a + (v * c) * dt``;
  ``x_prev = mean + ns * noise`` (noise path); ``d = x_prev.detach() - mean``;
  ``e = (-(d * d)) / var2 - log_ns - LOG_SQRT_2PI``.
* ``logp = tree_sum(e.flatten(1), -1) / n`` with the fixed pairwise tree of ``tree.py`` over the
  ``n`` elements of that sample (``n`` as FP32). The tree depends only on ``n``.

``logp`` is computed from ``x_prev`` in both paths, so the recompute path (``prev_sample=`` the
recorded ``x_prev``) reproduces the rollout's ``logp`` bytes. Gradients flow from ``logp`` to ``v``
(and ``x``) through ``mean`` with plain autograd; ``x_prev`` is detached inside ``logp`` as Flow-GRPO
does.

Last step (``sigma_prev == 0``): ``dt = -sigma`` and ``std`` stays finite for ``sigma < 1``, so the
step is a proper stochastic step onto ``sigma = 0`` with finite ``logp`` (Flow-GRPO applies the same
formula at every step). With a single step (``sigma == 1``, ``sigma_prev == 0``) the ``sigma_max``
branch gives ``std = eta / sqrt(1 - sigma_max)``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .tree import TREE_ORDER, sqrt_rn, tree_sum
from ._register import register_sampling_op

__all__ = ["SDEStepResult", "sde_step", "euler_step", "gaussian_kl", "LOG_SQRT_2PI"]


#: log(sqrt(2 pi)) in float64, rounded once to FP32.
LOG_SQRT_2PI = float(torch.tensor(0.5 * math.log(2.0 * math.pi), dtype=torch.float32))


class SDEStepResult(NamedTuple):
    """Output of :func:`sde_step`.

    Attributes:
        x_prev: ``(B, ...)`` FP32, the sample at ``sigma_prev``.
        logp: ``(B,)`` FP32, mean per-element log-density of ``x_prev`` under ``N(mean, (std sqrt(-dt))^2)``.
        mean: ``(B, ...)`` FP32, the transition mean.
        std: ``(B,)`` FP32, Flow-GRPO's ``std_dev_t`` (without the ``sqrt(-dt)`` factor).
    """

    x_prev: torch.Tensor
    logp: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


# ----------------------------------------------------------------------------------------------
# input checks
# ----------------------------------------------------------------------------------------------


def _check_data(name: str, t: torch.Tensor, like: torch.Tensor | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise ValueError(f"{name} must be float32 (the SDE step and logp run in FP32), got {t.dtype}")
    if like is None:
        if t.dim() < 2 or t.shape[0] == 0 or t[0].numel() == 0:
            raise ValueError(f"{name} must have shape (B, ...) with B >= 1 and a non-empty sample, got {tuple(t.shape)}")
    else:
        if t.shape != like.shape:
            raise ValueError(f"{name} must have the shape of x {tuple(like.shape)}, got {tuple(t.shape)}")
        if t.device != like.device:
            raise ValueError(f"{name} must be on the device of x ({like.device}), got {t.device}")
    if not bool(torch.isfinite(t.detach()).all()):
        raise ValueError(f"{name} contains NaN or Inf")


def _sigma_vector(name: str, s: object, batch: int) -> torch.Tensor:
    """A Python float, 0-d or (B,) FP32 tensor → (B,) FP32 CPU tensor."""
    if isinstance(s, bool):
        raise TypeError(f"{name} must be a float or a float32 tensor, got bool")
    if isinstance(s, (int, float)):
        vec = torch.full((batch,), float(s), dtype=torch.float32)
    elif isinstance(s, torch.Tensor):
        if s.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 when given as a tensor (take it from the sigma table), got {s.dtype}")
        if s.dim() == 0:
            vec = s.detach().to("cpu").reshape(1).expand(batch).clone()
        elif s.dim() == 1 and s.shape[0] == batch:
            vec = s.detach().to("cpu").clone()
        else:
            raise ValueError(f"{name} must be a float, a 0-d tensor or a ({batch},) tensor, got shape {tuple(s.shape)}")
    else:
        raise TypeError(f"{name} must be a float or a float32 tensor, got {type(s).__name__}")
    if not bool(torch.isfinite(vec).all()):
        raise ValueError(f"{name} contains NaN or Inf")
    return vec


def _check_schedule(sigma: torch.Tensor, sigma_prev: torch.Tensor) -> None:
    if bool((sigma <= 0).any()) or bool((sigma > 1).any()):
        raise ValueError(f"sigma must be in (0, 1], got {sigma.tolist()}")
    if bool((sigma_prev < 0).any()):
        raise ValueError(f"sigma_prev must be >= 0, got {sigma_prev.tolist()}")
    if bool((sigma_prev >= sigma).any()):
        raise ValueError(
            f"sigma_prev must be < sigma (the step goes towards sigma = 0), got sigma={sigma.tolist()} "
            f"sigma_prev={sigma_prev.tolist()}"
        )


def _batch_view(vec: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) CPU FP32 → (B, 1, ..., 1) on ``like``'s device (an exact copy)."""
    return vec.to(like.device).view(-1, *([1] * (like.dim() - 1)))


# ----------------------------------------------------------------------------------------------
# per-sample coefficients (CPU, FP32)
# ----------------------------------------------------------------------------------------------


class _Coefficients(NamedTuple):
    dt: torch.Tensor
    std: torch.Tensor
    a: torch.Tensor
    c: torch.Tensor
    ns: torch.Tensor
    var2: torch.Tensor
    log_ns: torch.Tensor


def _coefficients(sigma: torch.Tensor, sigma_prev: torch.Tensor, sigma_max: float, eta: float) -> _Coefficients:
    f32 = torch.float32
    one = torch.tensor(1.0, dtype=f32)
    two = torch.tensor(2.0, dtype=f32)
    smax = torch.tensor(sigma_max, dtype=f32)
    eta32 = torch.tensor(eta, dtype=f32)
    dt = sigma_prev - sigma
    std = sqrt_rn(sigma / (one - torch.where(sigma == one, smax, sigma))) * eta32
    std2 = std * std
    a = (std2 / (two * sigma)) * dt + one
    c = (std2 * (one - sigma)) / (two * sigma) + one
    ns = std * sqrt_rn(-dt)
    var2 = two * (ns * ns)
    log_ns = torch.tensor([math.log(v) for v in ns.tolist()], dtype=f32)
    if not (bool(torch.isfinite(std).all()) and bool((ns > 0).all()) and bool(torch.isfinite(log_ns).all())):
        raise ValueError(f"degenerate SDE step: std={std.tolist()} std*sqrt(-dt)={ns.tolist()}")
    return _Coefficients(dt, std, a, c, ns, var2, log_ns)


# ----------------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------------


def sde_step(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_prev: float | torch.Tensor,
    *,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    eta: float = 0.7,
    sigma_max: float,
) -> SDEStepResult:
    """One Flow-GRPO SDE step with its log-probability.

    Args:
        v: velocity ``(B, ...)`` FP32 (the CFG-combined model output), may require grad.
        x: current latents ``(B, ...)`` FP32, same shape and device.
        sigma: current sigma in ``(0, 1]``: Python float, 0-d or ``(B,)`` FP32 tensor.
        sigma_prev: next sigma in ``[0, sigma)``, same forms.
        noise: standard normal ``(B, ...)`` FP32 (rollout path). Exactly one of ``noise`` / ``prev_sample``.
        prev_sample: recorded ``x_prev`` ``(B, ...)`` FP32 (recompute / training path).
        eta: noise level, finite and ``> 0``.
        sigma_max: ``table[1]``, in ``[0, 1)``; used in place of ``sigma`` where ``sigma == 1``.

    Returns:
        :class:`SDEStepResult` ``(x_prev, logp, mean, std)``.
    """
    if (noise is None) == (prev_sample is None):
        raise ValueError("give exactly one of noise= (rollout) or prev_sample= (recompute)")
    _check_data("x", x)
    _check_data("v", v, like=x)
    if noise is not None:
        _check_data("noise", noise, like=x)
    else:
        _check_data("prev_sample", prev_sample, like=x)
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not math.isfinite(eta) or eta <= 0:
        raise ValueError(f"eta must be a finite float > 0, got {eta!r}")
    if isinstance(sigma_max, bool) or not isinstance(sigma_max, (int, float)) or not (0.0 <= sigma_max < 1.0):
        raise ValueError(f"sigma_max must be a float in [0, 1) (the sigma table's entry 1), got {sigma_max!r}")

    batch = x.shape[0]
    s = _sigma_vector("sigma", sigma, batch)
    sp = _sigma_vector("sigma_prev", sigma_prev, batch)
    _check_schedule(s, sp)
    k = _coefficients(s, sp, float(sigma_max), float(eta))

    a, c, dt = _batch_view(k.a, x), _batch_view(k.c, x), _batch_view(k.dt, x)
    mean = x * a + (v * c) * dt
    if noise is not None:
        x_prev = mean + _batch_view(k.ns, x) * noise
    else:
        x_prev = prev_sample
    d = x_prev.detach() - mean
    elem = (-(d * d)) / _batch_view(k.var2, x) - _batch_view(k.log_ns, x) - LOG_SQRT_2PI
    flat = elem.reshape(batch, -1)
    count = torch.tensor(float(flat.shape[1]), dtype=torch.float32, device=x.device)
    logp = tree_sum(flat, dim=-1) / count
    return SDEStepResult(x_prev=x_prev, logp=logp, mean=mean, std=k.std.to(x.device))


def euler_step(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_prev: float | torch.Tensor,
) -> torch.Tensor:
    """Deterministic flow-matching Euler step ``x + (sigma_prev - sigma) * v`` (FP32).

    Byte-equal to diffusers' ``FlowMatchEulerDiscreteScheduler.step`` for FP32 inputs: ``dt`` is one
    FP32 subtraction of the two table entries, then one multiply and one add.

    Args:
        v: velocity ``(B, ...)`` FP32.
        x: current latents ``(B, ...)`` FP32.
        sigma: current sigma in ``(0, 1]`` (float, 0-d or ``(B,)`` FP32 tensor).
        sigma_prev: next sigma in ``[0, sigma)``.

    Returns:
        ``(B, ...)`` FP32 latents at ``sigma_prev``.
    """
    _check_data("x", x)
    _check_data("v", v, like=x)
    batch = x.shape[0]
    s = _sigma_vector("sigma", sigma, batch)
    sp = _sigma_vector("sigma_prev", sigma_prev, batch)
    _check_schedule(s, sp)
    dt = _batch_view(sp - s, x)
    return x + dt * v


def gaussian_kl(mean_a: torch.Tensor, mean_b: torch.Tensor, std: float | torch.Tensor) -> torch.Tensor:
    """Per-sample KL between ``N(mean_a, std^2 I)`` and ``N(mean_b, std^2 I)``, averaged over elements.

    ``kl = tree_sum(((a - b) * (a - b)).flatten(1)) / n / (2 * std * std)`` (FP32, fixed tree). Pass
    ``std = result.std * sqrt(-dt)`` for the KL of the actual transitions, or ``result.std`` for
    Flow-GRPO's KL-loss convention.

    Args:
        mean_a, mean_b: ``(B, ...)`` FP32 transition means, same shape and device.
        std: ``> 0``; a Python float or an FP32 tensor of shape ``()`` or ``(B,)``.

    Returns:
        ``(B,)`` FP32.
    """
    _check_data("mean_a", mean_a)
    _check_data("mean_b", mean_b, like=mean_a)
    batch = mean_a.shape[0]
    sd = _sigma_vector("std", std, batch)
    if bool((sd <= 0).any()):
        raise ValueError(f"std must be > 0, got {sd.tolist()}")
    diff = mean_a - mean_b
    flat = (diff * diff).reshape(batch, -1)
    count = torch.tensor(float(flat.shape[1]), dtype=torch.float32, device=mean_a.device)
    two = torch.tensor(2.0, dtype=torch.float32)
    denom = (two * sd * sd).to(mean_a.device)
    return (tree_sum(flat, dim=-1) / count) / denom


register_sampling_op("flow_sde_step_logp", sde_step, "mmdit_strict.sampling.sde.sde_step",
                     f"logp: per-sample mean over flattened elements, {TREE_ORDER}, then / n")
register_sampling_op("flow_euler_step", euler_step, "mmdit_strict.sampling.sde.euler_step",
                     "none (elementwise FP32: one subtraction of the two table entries, one multiply, one add)")

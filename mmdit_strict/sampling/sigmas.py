"""Qwen-Image flow-matching sigma schedule (operator ``flow_sigma_table``, forward only).

Math (docs/design.md §2):

    mu        = image_seq_len * m + b,   m = (max_shift - base_shift) / (max_seq_len - base_seq_len),
                                         b = base_shift - m * base_seq_len          (Python float64)
    t_i       = linspace(1, 1/N, N)                                                  (float64, then FP32)
    s_i       = e^mu / (e^mu + (1/t_i - 1))                                          (exponential shift, FP32)
    sigma_i   = 1 - (1 - s_i) / ((1 - s_{N-1}) / (1 - shift_terminal))               (terminal stretch, FP32)
    table     = [sigma_0, ..., sigma_{N-1}, 0]

Arithmetic, op for op what ``QwenImagePipeline`` + ``FlowMatchEulerDiscreteScheduler.set_timesteps``
do (NumPy >= 2 / NEP 50 promotion: a Python float meeting an FP32 array is rounded to FP32 first):

1. ``mu`` in Python float64, same expression order as diffusers' ``calculate_shift``.
2. ``linspace`` in float64 exactly as NumPy computes it (``arange(N) * ((stop - start) / (N - 1)) + start``,
   last entry overwritten with ``stop``), then one round to FP32.
3. ``e^mu`` (``math.exp``, float64) rounded once to FP32; ``(1 - shift_terminal)`` likewise.
4. Every further op is one FP32 ``/``, ``-`` or ``+`` (the ``** 1.0`` of the shift is the identity
   and is skipped). These are correctly rounded IEEE operations, so the bytes do not depend on the
   device; the table is nevertheless always computed on the CPU and then moved to ``device``.

The result is byte-equal to diffusers' ``scheduler.sigmas`` for every ``num_steps >= 2``.
``num_steps == 1`` is where diffusers divides 0 by 0 in the terminal stretch and returns
``[nan, 0]``; we return ``[1, 0]`` (the stretch is the identity on a single entry ``1``), a
documented, intentional difference.
"""

from __future__ import annotations

import math

import torch

from ._checks import check_int
from ._register import register_sampling_op

__all__ = ["sigma_table", "mu_for"]


def mu_for(
    image_seq_len: int,
    *,
    base_seq_len: int = 256,
    max_seq_len: int = 8192,
    base_shift: float = 0.5,
    max_shift: float = 0.9,
) -> float:
    """The exponential-shift parameter ``mu`` for ``image_seq_len`` packed image tokens.

    Linear in the token count: ``base_shift`` at ``base_seq_len`` tokens, ``max_shift`` at
    ``max_seq_len`` (extrapolated outside that range, as diffusers does). Python float64, with the
    same expression order as diffusers' ``calculate_shift``.
    """
    check_int("image_seq_len", image_seq_len, 1)
    if max_seq_len == base_seq_len:
        raise ValueError(f"max_seq_len and base_seq_len must differ, both are {base_seq_len}")
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


def _linspace_f64(start: float, stop: float, num: int) -> torch.Tensor:
    """``numpy.linspace(start, stop, num)`` (endpoint=True) reproduced in torch float64, bit for bit."""
    y = torch.arange(num, dtype=torch.float64)
    div = num - 1
    delta = stop - start
    if div > 0:
        step = delta / div
        if step == 0:  # NumPy's denormal branch (unreachable for our start/stop, kept for fidelity)
            y = (y / div) * delta
        else:
            y = y * step
    else:
        y = y * delta
    y = y + start
    if num > 1:
        y[-1] = stop
    return y


def sigma_table(
    num_steps: int,
    image_seq_len: int,
    *,
    base_seq_len: int = 256,
    max_seq_len: int = 8192,
    base_shift: float = 0.5,
    max_shift: float = 0.9,
    shift_terminal: float = 0.02,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The FP32 sigma table for ``num_steps`` denoising steps at ``image_seq_len`` packed tokens.

    Args:
        num_steps: number of denoising steps ``N >= 1``.
        image_seq_len: packed image tokens (``(H/16) * (W/16)`` for an ``H x W`` image), ``>= 1``.
        base_seq_len, max_seq_len, base_shift, max_shift: the linear ``mu`` rule (see :func:`mu_for`).
        shift_terminal: the value the last non-zero sigma is stretched to, in ``(0, 1)``;
            ``0`` disables the stretch (as diffusers does for a falsy value).
        device: where to put the result (computed on the CPU; the bytes are device-independent).

    Returns:
        ``(num_steps + 1,)`` FP32 tensor, decreasing from 1.0, last entry 0.0.
    """
    check_int("num_steps", num_steps, 1)
    mu = mu_for(
        image_seq_len,
        base_seq_len=base_seq_len,
        max_seq_len=max_seq_len,
        base_shift=base_shift,
        max_shift=max_shift,
    )
    return sigma_table_for_mu(num_steps, mu, shift_terminal=shift_terminal, device=device)


def sigma_table_for_mu(num_steps: int, mu: float, *, shift_terminal: float = 0.02,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """:func:`sigma_table` from the shift parameter ``mu`` itself (what diffusers' pipelines hand their
    scheduler's ``set_timesteps``): the same FP32 operations, ``(num_steps + 1,)``."""
    check_int("num_steps", num_steps, 1)
    if not (0.0 <= shift_terminal < 1.0):
        raise ValueError(f"shift_terminal must be in [0, 1), got {shift_terminal}")
    if not math.isfinite(mu) or mu > 80.0:
        raise ValueError(f"mu = {mu} is out of range (exp(mu) would overflow FP32)")

    f32 = torch.float32
    t = _linspace_f64(1.0, 1.0 / num_steps, num_steps).to(f32)
    one = torch.tensor(1.0, dtype=f32)
    exp_mu = torch.tensor(math.exp(mu), dtype=f32)  # float64 exp, one round to FP32
    shifted = exp_mu / (exp_mu + (one / t - one))
    if shift_terminal and num_steps > 1:
        one_minus = one - shifted
        scale = one_minus[-1] / torch.tensor(1.0 - shift_terminal, dtype=f32)
        shifted = one - one_minus / scale
    table = torch.cat([shifted, torch.zeros(1, dtype=f32)])
    if device is not None:
        table = table.to(device)
    return table


register_sampling_op("flow_sigma_table", sigma_table, "mmdit_strict.sampling.sigmas.sigma_table",
                     "none (elementwise FP32 on the CPU; diffusers/NumPy op order)")

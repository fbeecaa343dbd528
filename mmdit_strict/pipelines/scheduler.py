"""A diffusers scheduler that runs our pinned sampling math: ``StrictFlowMatchScheduler``.

It speaks diffusers' scheduler API (``set_timesteps``, ``step``, ``scale_noise``, ``save_pretrained`` /
``from_pretrained`` / ``from_config``), so it drops into ``QwenImagePipeline`` (or any flow-matching pipeline)
in place of ``FlowMatchEulerDiscreteScheduler``, and every call goes through our traced sampling
operators:

* ``set_timesteps``: the FP32 sigma table (``flow_sigma_table``) from the ``mu`` the pipeline computes;
  ``timesteps = table[:-1] · num_train_timesteps``, as diffusers does.
* ``step``: with ``sde=False`` the FP32 Euler step (``flow_euler_step``, byte-equal to diffusers' for FP32
  latents); with ``sde=True`` the Flow-GRPO SDE step and its log-probability (``flow_sde_step_logp``, noise
  level ``eta``), whose ``log_prob`` is returned beside ``prev_sample``. The noise is keyed by
  ``(noise_seed, sample index, step)`` when ``noise_seed`` is set (the rollout's rule), else drawn from the
  call's ``generator``.

Only Qwen-Image's schedule is implemented (dynamic exponential shifting with a terminal stretch); other
settings, custom timesteps and custom sigmas other than the pipeline's default spacing are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.utils import BaseOutput
from diffusers.utils.torch_utils import randn_tensor

from ..sampling import euler_step, sde_step
from ..sampling.noise import step_noise
from ..sampling.sigmas import sigma_table_for_mu
from ..trajectories.engine import sampling_op


@dataclass
class StrictSchedulerOutput(BaseOutput):
    """``prev_sample`` in the model output's dtype; ``log_prob`` ``(B,)`` FP32 of the SDE transition (None for Euler)."""

    prev_sample: torch.Tensor
    log_prob: torch.Tensor | None = None


class StrictFlowMatchScheduler(SchedulerMixin, ConfigMixin):
    """``FlowMatchEulerDiscreteScheduler``'s API over the project's pinned sigma table, Euler and SDE steps."""

    config_name = "scheduler_config.json"
    order = 1

    @register_to_config
    def __init__(self, num_train_timesteps: int = 1000, shift: float = 1.0, use_dynamic_shifting: bool = True,
                 base_shift: float = 0.5, max_shift: float = 0.9, base_image_seq_len: int = 256,
                 max_image_seq_len: int = 8192, shift_terminal: float = 0.02, time_shift_type: str = "exponential",
                 sde: bool = False, eta: float = 0.7, noise_seed: int | None = None) -> None:
        if not use_dynamic_shifting or time_shift_type != "exponential" or shift != 1.0:
            raise ValueError("StrictFlowMatchScheduler implements Qwen-Image's schedule only: use_dynamic_shifting=True, "
                             f"time_shift_type='exponential', shift=1.0 (got {use_dynamic_shifting}, {time_shift_type!r}, {shift})")
        if not 0.0 <= shift_terminal < 1.0:
            raise ValueError(f"shift_terminal must be in [0, 1), got {shift_terminal}")
        if eta < 0:
            raise ValueError(f"eta must be >= 0, got {eta}")
        self.timesteps: torch.Tensor | None = None
        self.sigmas: torch.Tensor | None = None
        self.num_inference_steps: int | None = None
        self._step_index: int | None = None
        self._begin_index: int | None = None

    @property
    def step_index(self) -> int | None:
        return self._step_index

    @property
    def begin_index(self) -> int | None:
        return self._begin_index

    def set_begin_index(self, begin_index: int = 0) -> None:
        self._begin_index = begin_index

    def set_timesteps(self, num_inference_steps: int | None = None, device: str | torch.device | None = None,
                      sigmas: Any = None, mu: float | None = None, timesteps: Any = None) -> None:
        """The sigma table for ``num_inference_steps`` (or ``len(sigmas)``) steps at shift ``mu``, on ``device``.

        The spacing before the shift is always ``linspace(1, 1/n, n)``, what Qwen-Image's pipelines pass as
        ``sigmas`` (diffusers' own default without ``sigmas`` spaces from the training range instead)."""
        if timesteps is not None:
            raise ValueError("custom timesteps are not supported: the strict scheduler pins its sigma table")
        n = num_inference_steps if num_inference_steps is not None else (len(sigmas) if sigmas is not None else None)
        if n is None or n < 1:
            raise ValueError("set_timesteps needs num_inference_steps >= 1 (or sigmas)")
        if sigmas is not None:
            default = np.linspace(1.0, 1.0 / n, n).astype(np.float32)
            if len(sigmas) != n or not np.array_equal(np.asarray(sigmas, dtype=np.float32), default):
                raise ValueError("custom sigmas are not supported: the strict scheduler pins its table "
                                 f"(expected the pipeline's default spacing linspace(1, 1/{n}, {n}))")
        if mu is None:
            raise ValueError("set_timesteps needs mu (the pipeline computes it from the image token count)")
        table = sampling_op("flow_sigma_table", sigma_table_for_mu, n, float(mu),
                            shift_terminal=float(self.config.shift_terminal))
        self.sigmas = table.to(device) if device is not None else table
        self.timesteps = self.sigmas[:-1] * self.config.num_train_timesteps
        self.num_inference_steps = n
        self._step_index = None
        self._begin_index = None

    def index_for_timestep(self, timestep: float | torch.Tensor) -> int:
        if self.timesteps is None:
            raise RuntimeError("call set_timesteps first")
        hits = (self.timesteps == torch.as_tensor(timestep, dtype=self.timesteps.dtype, device=self.timesteps.device)).nonzero()
        if len(hits) == 0:
            raise ValueError(f"timestep {float(timestep)} is not in this schedule")
        return int(hits[1 if len(hits) > 1 else 0])

    def _init_step_index(self, timestep: float | torch.Tensor) -> None:
        self._step_index = self.index_for_timestep(timestep) if self._begin_index is None else self._begin_index

    def step(self, model_output: torch.Tensor, timestep: float | torch.Tensor, sample: torch.Tensor,
             generator: torch.Generator | list[torch.Generator] | None = None, return_dict: bool = True,
             prev_sample: torch.Tensor | None = None, **_unused: Any) -> StrictSchedulerOutput | tuple:
        """One denoising step from ``sample`` at ``timestep`` with velocity ``model_output`` (both ``(B, ...)``).

        With ``sde=True`` and ``prev_sample`` given, that recorded sample is scored instead of drawing one
        (Flow-GRPO's recompute): ``log_prob`` is its log-probability and ``prev_sample`` is returned as given."""
        if self.sigmas is None:
            raise RuntimeError("call set_timesteps before step")
        if self._step_index is None:
            self._init_step_index(timestep)
        i = self._step_index
        if i + 1 >= len(self.sigmas):
            raise IndexError(f"step {i} is past the last of {len(self.sigmas) - 1} steps")
        v, x = model_output.float(), sample.float()
        sigma, sigma_prev = self.sigmas[i], self.sigmas[i + 1]
        log_prob = None
        if not self.config.sde:
            out = sampling_op("flow_euler_step", euler_step, v, x, sigma, sigma_prev)
        else:
            kw = dict(eta=float(self.config.eta), sigma_max=float(self.sigmas[1]))
            if prev_sample is not None:
                res = sampling_op("flow_sde_step_logp", sde_step, v, x, sigma, sigma_prev, prev_sample=prev_sample.float(), **kw)
                out = prev_sample.float()
            else:
                if self.config.noise_seed is not None:
                    noise = sampling_op("step_noise", step_noise, int(self.config.noise_seed), list(range(x.shape[0])), i,
                                        tuple(x.shape[1:]), x.device)
                else:
                    noise = randn_tensor(x.shape, generator=generator, device=x.device, dtype=torch.float32)
                res = sampling_op("flow_sde_step_logp", sde_step, v, x, sigma, sigma_prev, noise=noise, **kw)
                out = res.x_prev
            log_prob = res.logp
        self._step_index = i + 1
        out = out.to(model_output.dtype)
        if not return_dict:
            return (out,) if log_prob is None else (out, log_prob)
        return StrictSchedulerOutput(prev_sample=out, log_prob=log_prob)

    def scale_noise(self, sample: torch.Tensor, timestep: float | torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """The forward process at ``timestep``: ``sigma · noise + (1 - sigma) · sample`` (image-to-image starts)."""
        if self.sigmas is None:
            raise RuntimeError("call set_timesteps before scale_noise")
        index = self._begin_index if self._begin_index is not None else self.index_for_timestep(
            torch.as_tensor(timestep).reshape(-1)[0])
        sigma = self.sigmas.to(device=sample.device, dtype=sample.dtype)[index]
        return sigma * noise + (1.0 - sigma) * sample

    def __len__(self) -> int:
        return int(self.config.num_train_timesteps)


__all__ = ["StrictFlowMatchScheduler", "StrictSchedulerOutput"]

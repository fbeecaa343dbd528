"""Optimizer, learning-rate schedule and EMA of the LoRA weights.

The LoRA parameters are handed to AdamW in parameter-name order (``foreach=False``: one parameter at a
time, the same arithmetic on every run), so a checkpointed optimizer state maps back by position.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..config.training import TrainConfig


def build_optimizer(params: Sequence[torch.nn.Parameter], tcfg: TrainConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``params`` with Flow-GRPO's knobs, and a linear warm-up then constant schedule.

    ``tcfg``'s values are checked when the config is composed (``config/validate.py``).
    """
    opt = torch.optim.AdamW(
        list(params), lr=tcfg.learning_rate, betas=(tcfg.adam_beta1, tcfg.adam_beta2),
        weight_decay=tcfg.adam_weight_decay, eps=tcfg.adam_epsilon, foreach=False,
    )
    warmup = tcfg.lr_warmup_steps

    def factor(update: int) -> float:
        return min(1.0, (update + 1) / warmup) if warmup > 0 else 1.0

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


class LoraEMA:
    """FP32 exponential moving average of named parameters: ``ema = decay · ema + (1 - decay) · p``."""

    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]], decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"train.ema_decay must be in [0, 1), got {decay}")
        self.decay = float(decay)
        self.params = list(named)
        self.shadow = {n: p.detach().to(torch.float32).clone() for n, p in self.params}

    @torch.no_grad()
    def update(self) -> None:
        for n, p in self.params:
            s = self.shadow[n]
            s.mul_(self.decay).add_(p.detach().to(torch.float32), alpha=1.0 - self.decay)

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange the live weights and the EMA weights (call twice to restore)."""
        for n, p in self.params:
            live = p.detach().to(torch.float32).clone()
            p.copy_(self.shadow[n].to(p.dtype))
            self.shadow[n] = live

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.shadow.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = sorted(set(self.shadow) - set(state))
        if missing:
            raise ValueError(f"EMA state misses {len(missing)} tensors, e.g. {missing[:3]}")
        self.shadow = {n: state[n].to(self.shadow[n].device, torch.float32).clone() for n in self.shadow}

"""The training-state hash the ranks compare: any changed byte of LoRA, optimizer or EMA state changes it."""

from __future__ import annotations

import torch

from mmdit_strict.training.optim import LoraEMA
from mmdit_strict.training.state import state_digest


def _state(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    named = [("a", torch.nn.Parameter(torch.randn(3, 2, generator=g))), ("b", torch.nn.Parameter(torch.randn(4, generator=g)))]
    opt = torch.optim.AdamW([p for _, p in named], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    ema = LoraEMA(named, 0.9)
    for _, p in named:
        p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    ema.update()
    return named, opt, sched, ema


def test_equal_states_hash_equal_and_any_flipped_bit_shows() -> None:
    base = state_digest(*_state())
    assert state_digest(*_state()) == base
    named, opt, sched, ema = _state()
    exp_avg = opt.state[named[0][1]]["exp_avg"]
    exp_avg.view(torch.int32)[0, 0] ^= 1  # one bit of the optimizer's first moment
    assert state_digest(named, opt, sched, ema) != base
    named, opt, sched, ema = _state()
    ema.shadow["b"].view(torch.int32)[2] ^= 1
    assert state_digest(named, opt, sched, ema) != base
    named, opt, sched, ema = _state()
    with torch.no_grad():
        named[1][1].view(torch.int32)[0] ^= 1
    assert state_digest(named, opt, sched, ema) != base
    assert state_digest(named, opt, sched, None) != state_digest(named, opt, sched, ema)

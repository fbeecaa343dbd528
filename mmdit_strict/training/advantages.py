"""GRPO advantages: rewards normalised per prompt (group) or over the whole epoch.

``A_i = (r_i - mean) / (std + 1e-4)`` with, per ``train.per_prompt_stat_tracking``:

* per prompt (default): mean and std (population, ``unbiased=False``) of that prompt's rewards in this
  epoch; with ``global_std`` the std is over every reward of the epoch;
* off: mean and std over every reward of the epoch.

All in FP64 on the CPU, in sample order. ``zero_std_ratio`` is the fraction of prompts whose group has
identical rewards (their advantages are all 0: no signal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

STD_EPS = 1e-4


@dataclass
class StatTracker:
    """Per-prompt reward statistics of the current epoch, plus a running history for logging and resume."""

    per_prompt: bool = True
    global_std: bool = False
    history: list[dict[str, Any]] = field(default_factory=list)  # one row per epoch

    def advantages(self, rewards: torch.Tensor, prompt_ids: Sequence[int]) -> tuple[torch.Tensor, dict[str, float]]:
        """``rewards``: ``(N,)``; ``prompt_ids``: ``N`` ints. Returns ``(N,)`` FP64 advantages and stats."""
        r = rewards.detach().to("cpu", torch.float64).reshape(-1)
        if r.shape[0] != len(prompt_ids):
            raise ValueError(f"{r.shape[0]} rewards for {len(prompt_ids)} prompt ids")
        if r.shape[0] == 0:
            raise ValueError("no rewards to normalise")
        ids = torch.tensor(list(prompt_ids))
        all_std = r.std(unbiased=False)
        adv = torch.empty_like(r)
        zero_std = 0
        groups = sorted(set(ids.tolist()))
        if self.per_prompt:
            for p in groups:
                sel = ids == p
                g = r[sel]
                std = all_std if self.global_std else g.std(unbiased=False)
                zero_std += int(bool((g == g[0]).all()))
                adv[sel] = (g - g.mean()) / (std + STD_EPS)
        else:
            adv = (r - r.mean()) / (all_std + STD_EPS)
            zero_std = sum(int(bool((r[ids == p] == r[ids == p][0]).all())) for p in groups)
        stats = {
            "zero_std_ratio": zero_std / len(groups),
            "adv_mean": float(adv.mean()), "adv_std": float(adv.std(unbiased=False)),
            "adv_min": float(adv.min()), "adv_max": float(adv.max()), "adv_abs_mean": float(adv.abs().mean()),
        }
        self.history.append({"reward_mean": float(r.mean()), "reward_std": float(all_std), **stats})
        return adv, stats

    def state_dict(self) -> dict[str, Any]:
        return {"per_prompt": self.per_prompt, "global_std": self.global_std, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.per_prompt = bool(state["per_prompt"])
        self.global_std = bool(state["global_std"])
        self.history = list(state["history"])

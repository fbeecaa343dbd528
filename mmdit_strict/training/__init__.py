"""Flow-GRPO training of a LoRA on the strict MMDiT (``mmdit-strict train``).

The rollout's own recorded logp is the old policy: strict rollout and strict training give the same
bytes, so the first update's importance ratios are exactly 1.0 without a recompute pass.
"""

from .loop import TrainResult, Trainer, run_training
from .rewards import RewardSet, available_rewards, register_reward

__all__ = ["Trainer", "TrainResult", "run_training", "RewardSet", "register_reward", "available_rewards"]

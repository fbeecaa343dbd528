"""The Qwen-Image MMDiT (production and strict forwards over one parameter tree)."""

from .checkpoint import CheckpointError, state_dict_hash
from .init import build_model, init_weights
from .mmdit import LORA_TARGETS, MMDiT, MMDiTOutput

__all__ = ["MMDiT", "MMDiTOutput", "LORA_TARGETS", "CheckpointError", "state_dict_hash", "build_model", "init_weights"]

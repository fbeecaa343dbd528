"""mmdit_strict: byte-identical rollout and training recomputation for Qwen-Image Flow-GRPO."""

from __future__ import annotations

__version__ = "0.1.0"

from . import sampling  # noqa: E402
from .config.arch import ArchConfig, preset  # noqa: E402
from .fingerprint import fingerprint  # noqa: E402
from .kernels.runtime import Runtime, runtime_mode  # noqa: E402
from .model import MMDiT, MMDiTOutput  # noqa: E402

__all__ = ["MMDiT", "MMDiTOutput", "ArchConfig", "preset", "fingerprint", "sampling", "Runtime", "runtime_mode", "__version__"]

"""Why not the batch-invariant kernels people already have? The peer survey: every operator family we ship
(projections with the modulation and fused GELU, LayerNorm modulation and gating, QK-norm + RoPE, joint
attention) run by each peer implementation that can run here — PyTorch eager with its determinism switches,
SDPA's backends, Liger-Kernel, Megatron-Core's batch-invariant kernels — through our own qualification
(raw-byte invariance, accuracy against the FP64 reference under our tolerance contract, speed against ours).

``python -m mmdit_strict.bench.peers --out DIR`` or ``mmdit-strict bench peers`` / ``qualify --section peers``.
"""

from .main import main

__all__ = ["main"]

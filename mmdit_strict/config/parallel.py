"""The ``parallel`` section of a side (``rollout``, ``recompute``, and the training rollout ``sample``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    """A side's model-parallel layout under torchrun (docs/parallel.md): ``tp · sp · cfg`` ranks share each batch."""

    tp: int = 1  # tensor parallel: every block GEMM split by output columns over tp ranks (heads with them)
    sp: int = 1  # sequence parallel: image rows of every sample split over sp ranks
    cfg: int = 1  # CFG parallel: 2 puts the conditional and the negative branch on two ranks
    attention: str = "ulysses"  # how sequence-parallel attention sees the whole sequence: ulysses | allgather

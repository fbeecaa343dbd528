"""PyTorch eager with its determinism switches: the production composition (``kernels/production.py``:
cuBLAS / ATen kernels, the eager epilogues, SDPA's default backend for attention) run under
``torch.use_deterministic_algorithms(True)``, ``cudnn.deterministic = True``, ``cudnn.benchmark = False``
and — on a GPU — ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which cuBLAS reads when CUDA initialises, so the
survey sets it before the first CUDA call (:func:`set_cublas_workspace`) and the report records whether it
was in effect. Deterministic means run-to-run equal at one shape; it promises nothing across batch shapes,
which is what the survey measures.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from ...kernels import production as P
from .cases import Case
from .impl import Impl, Missing

PEER = "torch-deterministic"
CUBLAS_WORKSPACE = ":4096:8"


def set_cublas_workspace() -> dict[str, object]:
    """Set ``CUBLAS_WORKSPACE_CONFIG`` unless set; returns what the report records: its value and whether
    CUDA was still uninitialised (only then does cuBLAS see it)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    return {"CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"],
            "set_before_cuda_init": not torch.cuda.is_initialized()}


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` (errors, not warnings) and cuDNN's deterministic flags,
    restored on exit."""
    prev = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = prev[2], prev[3]


def eager_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, prologue: str, epilogue: str) -> torch.Tensor:
    """``epilogue(prologue(x) Wᵀ + b)`` in eager PyTorch (``F.linear`` and the eager activations)."""
    return P.apply_epilogue(F.linear(P.apply_prologue(x, prologue), w, b), epilogue)


def _fn(case: Case):
    cfg = case.config or {}
    if case.family == "projection":
        return lambda x, w, b, *, seqlens: (eager_linear(x, w, b, cfg["prologue"], cfg["epilogue"]),)
    if case.op == "adaln_modulation":
        return lambda x, sh, sc, *, seqlens: (P.adaln_modulation(x, sh, sc, seqlens=seqlens[0], eps=cfg["eps"]),)
    if case.op == "adaln_gate_residual":
        return lambda x, y, gt, *, seqlens: (P.adaln_gate_residual(x, y, gt, seqlens=seqlens[0]),)
    if case.family == "qk_norm_rope":
        return lambda x, c, s, gain, *, seqlens: (P.multi_axis_rope(P.qk_rmsnorm(x, gain, seqlens=seqlens[0], eps=cfg["eps"]), c, s),)
    return lambda qt, kt, vt, qi, ki, vi, *, seqlens: tuple(
        P.joint_attention_fused(qt, kt, vt, qi, ki, vi, txt_seqlens=seqlens[0], img_seqlens=seqlens[1]))


_NOTES = {"projection": "F.linear (cuBLAS / CPU BLAS) + eager prologue/epilogue",
          "norms": "F.layer_norm / elementwise eager ops",
          "qk_norm_rope": "eager RMSNorm then the eager complex-pair rotation",
          "attention": "padded batch + key mask through SDPA's default backend"}


def implementations(cases: Sequence[Case], device: str, dtype: torch.dtype) -> list[Impl | Missing]:
    """The eager composition of every case, each run under :func:`deterministic`."""
    return [Impl(PEER, PEER, c.op, _fn(c), _NOTES[c.family] + ", deterministic algorithms on", deterministic) for c in cases]

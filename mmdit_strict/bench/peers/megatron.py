"""Megatron-Core's batch-invariant kernels (``megatron/core/transformer/custom_layers/batch_invariant_kernels.py``,
adapted by Megatron from Thinking Machines' ``batch_invariant_ops``): a persistent Triton matmul that replaces
``aten::mm`` / ``aten::addmm`` inside ``set_batch_invariant_mode()``, a Triton ``mean_dim`` that replaces
``aten::mean.dim``, and ``rmsnorm_batch_invariant`` built on it.

The module is loaded on its own from the installed files (``importlib.util.spec_from_file_location``): it needs
only torch and Triton, while importing the ``megatron.core`` package pulls in what a bare GPU image lacks. Its own
``set_batch_invariant_mode()`` also patches Transformer Engine and fails without it (``import transformer_engine``),
so :func:`aten_mode` registers the module's published ATen replacements (``mm_batch_invariant``,
``addmm_batch_invariant``, ``mean_batch_invariant``) the way that mode does, and leaves Transformer Engine out.

* Projections: eager ``F.linear`` (+ the eager SiLU prologue / GELU epilogue) inside :func:`aten_mode`, so the
  forward and both backward GEMMs run the persistent kernel (the bias gradient is an ATen sum). On the CPU this
  runs under ``TRITON_INTERPRET=1`` (the test suite), which keeps the adapter from rotting.
* adaLN modulation: a LayerNorm from ``x.mean(-1)`` under the mode (the Triton ``mean_dim``) + the eager
  modulation — the module has no LayerNorm kernel; this is its primitives composed.
* QK-norm + RoPE: ``rmsnorm_batch_invariant`` per head, then the eager rotation.
* Gated residual and attention: no kernel in the module (only a tile size for attention elsewhere).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, ContextManager, Iterator, Sequence

import torch

from ...kernels import production as P
from .cases import Case
from .impl import Impl, Missing
from .torch_det import eager_linear

PEER = "megatron-core"
MODULE = "megatron/core/transformer/custom_layers/batch_invariant_kernels.py"
_NAME = "_mmdit_peer_megatron_bik"
_NONE = {"adaln_gate_residual": "Megatron-Core's module has no gated-residual kernel",
         "attention": "Megatron-Core's batch-invariant module has no attention kernel"}


def module_path() -> Path | None:
    """The installed ``batch_invariant_kernels.py``, found without importing the ``megatron`` package."""
    for entry in sys.path:
        p = Path(entry or ".") / MODULE
        if p.is_file():
            return p
    return None


def load() -> ModuleType:
    """The module, loaded alone from the installed files (cached in ``sys.modules`` under a private name)."""
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    path = module_path()
    if path is None:
        raise ImportError(f"megatron-core is not installed ({MODULE} is on no sys.path entry); pip install '.[bench]'")
    spec = importlib.util.spec_from_file_location(_NAME, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[_NAME]
        raise
    return mod


def unavailable(device: str, family: str) -> str | None:
    """Why Megatron's kernels cannot run ``family`` here, or None."""
    try:
        load()
    except ImportError as exc:
        return str(exc)
    if device == "cuda":
        return None
    if family == "projection":
        if os.environ.get("TRITON_INTERPRET") == "1":
            return None
        return "Megatron-Core's persistent matmul is a Triton kernel: CUDA, or the CPU under TRITON_INTERPRET=1"
    return "Megatron-Core's mean_dim and its RMSNorm assert CUDA tensors"


def aten_mode(mod: ModuleType, device: str) -> Callable[[], ContextManager[None]]:
    """A context that routes ``aten::mm`` / ``addmm`` (and on CUDA ``mean.dim``) of ``device`` to the module's
    batch-invariant replacements, as its ``enable_batch_invariant_mode`` does, without the Transformer Engine patches."""
    key = "CUDA" if device == "cuda" else "CPU"

    @contextlib.contextmanager
    def ctx() -> Iterator[None]:
        lib = torch.library.Library("aten", "IMPL")
        try:
            lib.impl("aten::mm", mod.mm_batch_invariant, key)
            lib.impl("aten::addmm", mod.addmm_batch_invariant, key)
            if device == "cuda":  # mean_dim asserts CUDA tensors
                lib.impl("aten::mean.dim", mod.mean_batch_invariant, key)
            yield
        finally:
            lib._destroy()

    return ctx


def implementations(cases: Sequence[Case], device: str, dtype: torch.dtype) -> list[Impl | Missing]:
    """Megatron's implementation of each case it has a kernel for; Missing (with the reason) for the rest."""
    out: list[Impl | Missing] = []
    for case in cases:
        none = _NONE.get(case.op) or _NONE.get(case.family)
        why = None if none else unavailable(device, case.family)
        if none or why:
            out.append(Missing(PEER, PEER, case.op, none or why or ""))
            continue
        mod = load()
        cfg = case.config or {}
        if case.family == "projection":
            fn = (lambda p, e: lambda x, w, b, *, seqlens: (eager_linear(x, w, b, p, e),))(cfg["prologue"], cfg["epilogue"])
            out.append(Impl(PEER, PEER, case.op, fn, "F.linear with aten::mm/addmm -> matmul_persistent (Triton) + eager prologue/epilogue", aten_mode(mod, device)))
        elif case.op == "adaln_modulation":
            eps = cfg["eps"]

            def modulation(x, shift, scale, *, seqlens, eps=eps):
                xf = x.float()
                mu = xf.mean(-1, keepdim=True)
                var = ((xf - mu) ** 2).mean(-1, keepdim=True)
                xh = ((xf - mu) * torch.rsqrt(var + eps)).to(x.dtype)
                return (xh * (1 + P.per_row(scale, x, seqlens[0])) + P.per_row(shift, x, seqlens[0]),)

            out.append(Impl(PEER, PEER, case.op, modulation, "LayerNorm from x.mean(-1) -> mean_dim (Triton, FP32) + eager modulation", aten_mode(mod, device)))
        else:
            eps = cfg["eps"]

            def qk(x, c, s, gain, *, seqlens, eps=eps):
                m, h, d = x.shape
                y = mod.rmsnorm_batch_invariant(x.reshape(m * h, d), gain, eps).view(m, h, d)
                return (P.multi_axis_rope(y, c, s),)

            out.append(Impl(PEER, PEER, case.op, qk, "rmsnorm_batch_invariant per head + eager rotation", aten_mode(mod, device)))
    return out

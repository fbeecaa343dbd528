"""Our operators as the survey runs them: the strict implementation the registry resolves for the device
and dtype (Triton on a GPU, the CPU strict backend on the CPU), called through its registered function."""

from __future__ import annotations

from typing import Sequence

import torch

from ...kernels.registry import NoStrictKernelError, resolve
from ...kernels.runtime import Runtime
from .cases import Case
from .impl import Impl, Missing

PEER = "ours"


def _strict(op: str, device: str, dtype: torch.dtype):
    return resolve(op, device, dtype, Runtime.STRICT)[0]


def _impl(case: Case, device: str, dtype: torch.dtype) -> Impl:
    cfg = case.config or {}
    if case.family == "projection":
        k = _strict(case.op, device, dtype)

        def fn(x, w, b, *, seqlens):
            return (k.fn(x, w, b, seqlens=seqlens[0], prologue=cfg["prologue"], epilogue=cfg["epilogue"]),)

        return Impl(PEER, PEER, case.op, fn, f"{k.backend}: {k.kernel_name}")
    if case.family == "norms":
        k = _strict(case.op, device, dtype)
        extra = {"eps": cfg["eps"]} if "eps" in cfg else {}

        def fn(*args, seqlens):
            return (k.fn(*args, seqlens=seqlens[0], **extra),)

        return Impl(PEER, PEER, case.op, fn, f"{k.backend}: {k.kernel_name}")
    if case.family == "qk_norm_rope":
        norm, rope = _strict("qk_rmsnorm", device, dtype), _strict("multi_axis_rope", device, dtype)
        fused = norm.fusions.get("multi_axis_rope") if norm.backend == rope.backend else None

        def fn(x, c, s, gain, *, seqlens):
            if fused is not None:
                return (fused(x, gain, c, s, seqlens=seqlens[0], eps=cfg["eps"]),)
            return (rope.fn(norm.fn(x, gain, seqlens=seqlens[0], eps=cfg["eps"]), c, s),)

        how = "fused qk_rmsnorm_rope" if fused is not None else f"{norm.kernel_name} then {rope.kernel_name}"
        return Impl(PEER, PEER, case.op, fn, f"{norm.backend}: {how}")
    k = _strict(case.op, device, dtype)

    def attn(qt, kt, vt, qi, ki, vi, *, seqlens):
        return tuple(k.fn(qt, kt, vt, qi, ki, vi, txt_seqlens=seqlens[0], img_seqlens=seqlens[1]))

    return Impl(PEER, PEER, case.op, attn, f"{k.backend}: {k.kernel_name}")


def implementations(cases: Sequence[Case], device: str, dtype: torch.dtype) -> list[Impl | Missing]:
    """Our strict implementation of every case on ``device``/``dtype`` (Missing where none is qualified)."""
    out: list[Impl | Missing] = []
    for case in cases:
        try:
            out.append(_impl(case, device, dtype))
        except NoStrictKernelError as exc:
            out.append(Missing(PEER, PEER, case.op, str(exc).split(" (registered")[0]))
    return out

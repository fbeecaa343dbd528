"""PyTorch SDPA's backends for the joint attention, each pinned with ``sdpa_kernel`` and run under the
determinism switches of :mod:`.torch_det`: the padded batch ``[text | image]`` with a key mask (what a
batched PyTorch MMDiT does, ``kernels/production.py``). A backend that refuses the call (no mask support,
no deterministic backward) is recorded as an error of that row, not hidden.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from ...kernels import production as P
from .cases import Case
from .impl import Impl, Missing
from .torch_det import deterministic

PEER = "sdpa"
#: backend name → (SDPBackend attribute, device types that have it)
BACKENDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "math": ("MATH", ("cpu", "cuda")),
    "flash": ("FLASH_ATTENTION", ("cpu", "cuda")),
    "efficient": ("EFFICIENT_ATTENTION", ("cuda",)),
    "cudnn": ("CUDNN_ATTENTION", ("cuda",)),
}


def _pinned(attr: str):
    @contextlib.contextmanager
    def ctx() -> Iterator[None]:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with deterministic(), sdpa_kernel([getattr(SDPBackend, attr)]):
            yield

    return ctx


def _attn(qt, kt, vt, qi, ki, vi, *, seqlens):
    return tuple(P.joint_attention_fused(qt, kt, vt, qi, ki, vi, txt_seqlens=seqlens[0], img_seqlens=seqlens[1]))


def implementations(cases: Sequence[Case], device: str, dtype: torch.dtype) -> list[Impl | Missing]:
    """One implementation per SDPA backend for the attention case; the other families are not SDPA's."""
    out: list[Impl | Missing] = []
    for case in cases:
        if case.family != "attention":
            continue
        for name, (attr, devices) in BACKENDS.items():
            label = f"{PEER}-{name}"
            if device not in devices:
                out.append(Missing(PEER, label, case.op, f"SDPA's {name} backend runs on {'/'.join(devices)} only"))
                continue
            out.append(Impl(PEER, label, case.op, _attn, f"padded batch + key mask, SDPBackend.{attr}, deterministic algorithms on",
                            _pinned(attr)))
    return out

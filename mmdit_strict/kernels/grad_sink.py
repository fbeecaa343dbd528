"""Split-invariant parameter gradients: per-sample partials folded in global sample order.

Autograd adds a parameter's gradient contributions in the order the backward passes run, so the
bytes of a LoRA gradient depend on how a batch was split into micro-batches. Inside a
:func:`collect_sample_grads` block, the strict GEMM backward also hands each sample's partial
``dZ_sᵀ X_s`` to a :class:`SampleGradSink`, keyed by the sample key the caller declared with
:func:`sample_keys` (for example ``(sample_id, cfg_branch)``). :meth:`SampleGradSink.fold` adds the
partials in sorted key order, so the result is the same bytes whatever the micro-batch split,
sample order or CFG layout (docs/design.md §3.6).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Hashable, Iterator, Sequence

import torch

_KEYS: contextvars.ContextVar[tuple[Hashable, ...] | None] = contextvars.ContextVar("mmdit_sample_keys", default=None)
_SINK: contextvars.ContextVar["SampleGradSink | None"] = contextvars.ContextVar("mmdit_grad_sink", default=None)


class SampleGradSink:
    """Per-(parameter, sample key) gradient partials and their ordered fold."""

    def __init__(self) -> None:
        self._parts: dict[int, dict[Hashable, torch.Tensor]] = {}
        self._params: dict[int, torch.Tensor] = {}

    def add(self, param: torch.Tensor, keys: Sequence[Hashable], partials: Sequence[torch.Tensor]) -> None:
        if len(keys) != len(partials):
            raise ValueError(f"{len(keys)} sample keys for {len(partials)} gradient partials")
        slot = self._parts.setdefault(id(param), {})
        self._params[id(param)] = param
        for k, p in zip(keys, partials):
            # a key may contribute more than once (e.g. a layer used twice); add in arrival order for that key
            slot[k] = p.detach().clone() if k not in slot else slot[k] + p.detach()

    def params(self) -> list[torch.Tensor]:
        return list(self._params.values())

    def fold(self, param: torch.Tensor) -> torch.Tensor | None:
        """Left fold of ``param``'s partials in sorted sample-key order (FP32), or None if it got none."""
        slot = self._parts.get(id(param))
        if not slot:
            return None
        acc = None
        for k in sorted(slot):
            acc = slot[k].clone() if acc is None else acc + slot[k]
        return acc


@contextlib.contextmanager
def collect_sample_grads(sink: SampleGradSink | None = None) -> Iterator[SampleGradSink]:
    """Forward and backward passes inside the block deposit per-sample partials into ``sink``."""
    sink = sink if sink is not None else SampleGradSink()
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        _SINK.reset(token)


@contextlib.contextmanager
def sample_keys(keys: Sequence[Hashable]) -> Iterator[None]:
    """Declare the sample key of each sample of the forward(s) run inside the block, in batch order."""
    token = _KEYS.set(tuple(keys))
    try:
        yield
    finally:
        _KEYS.reset(token)


def active() -> tuple[SampleGradSink | None, tuple[Hashable, ...] | None]:
    """The sink and sample keys in force (read by operators at forward time)."""
    return _SINK.get(), _KEYS.get()


@contextlib.contextmanager
def restore(state: tuple[SampleGradSink | None, tuple[Hashable, ...] | None]) -> Iterator[None]:
    """Re-establish a sink/keys state captured with :func:`active` (for checkpoint recomputation)."""
    t1, t2 = _SINK.set(state[0]), _KEYS.set(state[1])
    try:
        yield
    finally:
        _KEYS.reset(t2)
        _SINK.reset(t1)

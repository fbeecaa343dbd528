"""LoRA-gradient partials of many ranks folded into the single-process bytes.

Each rank's gradient sink holds, per trained parameter, one FP32 partial per sample key it ran
(keys are global: ``(sample_id, cfg_branch)``). The fold across ranks is not a reduction of per-rank
sums: every rank's per-key partials are moved whole to rank 0, which deposits them into one stored
:class:`~mmdit_strict.kernels.grad_sink.SampleGradSink` and takes its fold — the left fold in sorted
key order, ``acc = P_k0; acc = acc + P_k1; …`` — which is the very fold a single process performs
over the same partials. The tree is therefore the single-process chain, whatever the number of
ranks; the cost is that rank 0 holds every partial of the step at once (the stored sink's memory).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..kernels.grad_sink import SampleGradSink


def rank_partials(trainable: Sequence[tuple[str, torch.Tensor]], sink: SampleGradSink) -> dict[str, Any]:
    """This rank's share: the names of the parameters that got a gradient, and their per-key partials (host FP32)."""
    with_grad = [n for n, p in trainable if p.grad is not None]
    parts = {n: {k: t.detach().cpu() for k, t in sink.partials(p).items()} for n, p in trainable if p.grad is not None}
    return {"with_grad": with_grad, "partials": parts}


def fold_ranks(name: str, shares: Sequence[dict[str, Any]]) -> torch.Tensor | None:
    """Parameter ``name``'s fold over every rank's partials in global key order; None when no rank had any."""
    sink = SampleGradSink()
    anchor = torch.empty(0)  # the sink keys parameters by identity: one stand-in for ``name``
    seen: dict[Any, int] = {}
    for r, share in enumerate(shares):
        parts = share["partials"].get(name, {})
        for k in parts:
            if k in seen:
                raise ValueError(f"sample key {k!r} of {name} came from rank {seen[k]} and rank {r}: a sample ran twice")
            seen[k] = r
        if parts:
            keys = list(parts)
            sink.add(anchor, keys, [parts[k] for k in keys], transfer=True)
    return sink.fold(anchor)

"""The prepacked ``Wᵀ (K, N)`` weight copy, owned by the weight tensor it was made from.

A forward whose configuration says ``weight_layout="kn"`` reads a contiguous transpose of
nn.Linear's ``(N, K)`` weight. The copy is stored on the weight tensor itself (one attribute, no
module-level cache): it lives exactly as long as that Parameter, costs that weight's size once, is
rebuilt when the weight changes in place (``_version`` or storage moved: optimizer step,
``load_state_dict``) and can be dropped with :func:`drop_prepacked`. Classes whose configuration
reads ``"nk"`` (the weight in place) never make one.
"""

from __future__ import annotations

import torch

_ATTR = "_mmdit_strict_packed_kn"  # (weight._version, weight.data_ptr(), packed (K, N))


def prepacked_weight(weight: torch.Tensor) -> torch.Tensor:
    """Contiguous ``Wᵀ (K, N)`` of ``weight (N, K)``, cached on ``weight`` for its current version.

    Pass the same weight tensor every call (e.g. the module's Parameter): a fresh tensor each call
    (a slice, a ``.to()``) packs each call and keeps nothing.
    """
    hit = getattr(weight, _ATTR, None)
    if hit is not None and hit[0] == weight._version and hit[1] == weight.data_ptr():
        return hit[2]
    packed = weight.detach().t().contiguous()
    setattr(weight, _ATTR, (weight._version, weight.data_ptr(), packed))
    return packed


def drop_prepacked(weight: torch.Tensor) -> None:
    """Free ``weight``'s prepacked copy, if it has one (it is rebuilt on the next ``"kn"`` forward)."""
    if hasattr(weight, _ATTR):
        delattr(weight, _ATTR)


def prepacked_bytes(weights) -> int:
    """Bytes held by the prepacked copies of ``weights`` (an iterable of tensors, e.g. ``model.parameters()``)."""
    total = 0
    for w in weights:
        hit = getattr(w, _ATTR, None)
        if hit is not None:
            total += hit[2].numel() * hit[2].element_size()
    return total

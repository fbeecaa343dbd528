"""Independent FP64 reference of the three-axis RoPE tables (docs/design.md §2, RoPE row).

Positions are integers, computed from the image grid and the prompt length alone:

* image token ``(f, r, c)`` of image ``k`` of a sample (row-major over frame, row, column) gets
  frame position ``k + f``, height position ``r − ceil(h/2)`` and width position ``c − ceil(w/2)``
  (centred: an ``h``-row grid spans ``−ceil(h/2) … floor(h/2) − 1``, as diffusers' ``scale_rope=True``);
* text token ``j`` gets position ``max_k(max(h_k // 2, w_k // 2)) + j`` on all three axes (the diagonal
  just past the image's largest positive index).

Angles: for an axis of ``n`` RoPE channels (``n/2`` rotation pairs), pair ``i`` turns by
``pos · theta^(−2i/n)``; the per-token angle vector is the concatenation over axes in (frame, height,
width) order, ``d/2`` angles for a head of width ``d``. The tables are ``cos`` and ``sin`` of it.
"""

from __future__ import annotations

from typing import Sequence

import torch

F64 = torch.float64

ImageShape = tuple[int, int, int]


def _normalize_shapes(shape: ImageShape | Sequence[ImageShape]) -> list[ImageShape]:
    """One sample's image shapes: a single ``(frame, h, w)`` or a list of them (diffusers' nesting)."""
    if len(shape) == 3 and all(isinstance(v, int) for v in shape):
        shapes = [tuple(shape)]
    else:
        shapes = [tuple(s) for s in shape]
    for s in shapes:
        if len(s) != 3 or any((not isinstance(v, int)) or v < 1 for v in s):
            raise ValueError(f"expected image shapes (frame, height, width) of positive ints, got {shape!r}")
    return shapes  # type: ignore[return-value]


def image_token_count(shape: ImageShape | Sequence[ImageShape]) -> int:
    """Number of image tokens of one sample (sum of ``frame·h·w`` over its images)."""
    return sum(f * h * w for f, h, w in _normalize_shapes(shape))


def image_positions(shape: ImageShape | Sequence[ImageShape]) -> torch.Tensor:
    """``(T_img, 3)`` int64 (frame, height, width) positions of one sample's image tokens."""
    rows = []
    for k, (frames, h, w) in enumerate(_normalize_shapes(shape)):
        for f in range(frames):
            for r in range(h):
                for c in range(w):
                    rows.append((k + f, r - (h - h // 2), c - (w - w // 2)))
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 3)


def text_positions(shape: ImageShape | Sequence[ImageShape], txt_len: int) -> torch.Tensor:
    """``(txt_len, 3)`` int64 positions of one sample's text tokens (same value on all three axes)."""
    if txt_len < 0:
        raise ValueError(f"txt_len must be non-negative, got {txt_len}")
    offset = max(max(h // 2, w // 2) for _, h, w in _normalize_shapes(shape))
    pos = offset + torch.arange(txt_len, dtype=torch.long)
    return pos[:, None].expand(txt_len, 3).clone()


def axis_inverse_frequencies(dim: int, theta: float = 10000.0) -> torch.Tensor:
    """``(dim/2,)`` FP64: ``theta^(−2i/dim)`` for ``i = 0 … dim/2 − 1``."""
    if dim % 2 or dim < 2:
        raise ValueError(f"an axis needs a positive even number of RoPE channels, got {dim}")
    i = torch.arange(dim // 2, dtype=F64)
    return torch.pow(torch.tensor(float(theta), dtype=F64), -2.0 * i / dim)


def rope_angles(
    positions: torch.Tensor, axes_dims: Sequence[int] = (16, 56, 56), theta: float = 10000.0
) -> torch.Tensor:
    """``(N, 3)`` integer positions → ``(N, sum(axes_dims)/2)`` FP64 rotation angles."""
    if positions.dim() != 2 or positions.shape[1] != len(axes_dims):
        raise ValueError(f"expected positions of shape (N, {len(axes_dims)}), got {tuple(positions.shape)}")
    pos = positions.to(F64)
    parts = [pos[:, a, None] * axis_inverse_frequencies(n, theta)[None, :] for a, n in enumerate(axes_dims)]
    return torch.cat(parts, dim=1)


def rope_tables(
    img_shapes: Sequence[ImageShape | Sequence[ImageShape]],
    txt_lens: Sequence[int],
    axes_dims: Sequence[int] = (16, 56, 56),
    theta: float = 10000.0,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per-sample RoPE tables ``(img_cos, img_sin, txt_cos, txt_sin)``, each ``(rows, d/2)`` FP64.

    Args:
        img_shapes: per sample, ``(frame, h, w)`` in tokens (latent size / patch), or a list of them.
        txt_lens: per sample, the number of (valid) text tokens.
        axes_dims: RoPE channels per axis (frame, height, width).
        theta: RoPE base.
    """
    if len(img_shapes) != len(txt_lens):
        raise ValueError(f"need one text length per sample: {len(img_shapes)} image shapes, {len(txt_lens)} lengths")
    tables = []
    for shape, n_txt in zip(img_shapes, txt_lens):
        img = rope_angles(image_positions(shape), axes_dims, theta)
        txt = rope_angles(text_positions(shape, int(n_txt)), axes_dims, theta)
        tables.append((torch.cos(img), torch.sin(img), torch.cos(txt), torch.sin(txt)))
    return tables


__all__ = [
    "axis_inverse_frequencies",
    "image_positions",
    "image_token_count",
    "rope_angles",
    "rope_tables",
    "text_positions",
]

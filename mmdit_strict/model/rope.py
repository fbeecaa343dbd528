"""Multi-axis RoPE tables for Qwen-Image (docs/design.md §2).

Angles are computed in FP64 on the CPU from integer positions and rounded once to FP32, so every
device and every batch composition gets the same table bytes. Axis order is (frame, height, width);
spatial indices are centred (``scale_rope``): a side of ``n`` cells gets ``-(n - n//2) .. n//2 - 1``.
Text token ``j`` sits on the diagonal at ``max(h//2, w//2) + j`` on all three axes.
"""

from __future__ import annotations

import functools
import numbers
from typing import Sequence

import torch

from ..kernels.keepalive import retain

ImgShape = tuple[int, int, int]


def _axis_inv_freq(dim: int, theta: float) -> torch.Tensor:
    # (dim/2,) FP64: theta^(-2i/dim)
    return 1.0 / torch.pow(torch.tensor(float(theta), dtype=torch.float64), torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def _centred(n: int) -> torch.Tensor:
    return torch.cat([torch.arange(-(n - n // 2), 0, dtype=torch.float64), torch.arange(0, n // 2, dtype=torch.float64)])


@functools.lru_cache(maxsize=256)
def _image_angles(shapes: tuple[ImgShape, ...], axes: tuple[int, int, int], theta: float) -> torch.Tensor:
    parts = []
    for idx, (f, h, w) in enumerate(shapes):
        pf = torch.arange(idx, idx + f, dtype=torch.float64)
        ph, pw = _centred(h), _centred(w)
        af = torch.outer(pf, _axis_inv_freq(axes[0], theta))[:, None, None, :].expand(f, h, w, -1)
        ah = torch.outer(ph, _axis_inv_freq(axes[1], theta))[None, :, None, :].expand(f, h, w, -1)
        aw = torch.outer(pw, _axis_inv_freq(axes[2], theta))[None, None, :, :].expand(f, h, w, -1)
        parts.append(torch.cat([af, ah, aw], dim=-1).reshape(f * h * w, -1))
    return torch.cat(parts, dim=0)


@functools.lru_cache(maxsize=256)
def _text_angles(start: int, length: int, axes: tuple[int, int, int], theta: float) -> torch.Tensor:
    pos = torch.arange(start, start + length, dtype=torch.float64)
    inv = torch.cat([_axis_inv_freq(a, theta) for a in axes])
    return torch.outer(pos, inv)


def text_offset(shapes: Sequence[ImgShape]) -> int:
    """First text position: ``max(h//2, w//2)`` over the sample's image shapes."""
    return max(max(h // 2, w // 2) for (_, h, w) in shapes)


def rope_tables(
    shapes: Sequence[ImgShape], txt_len: int, axes_dims: Sequence[int], theta: float, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample FP32 tables: ``(img_cos, img_sin, txt_cos, txt_sin)``, each ``(tokens, head_dim/2)``."""
    shapes_t = tuple((int(f), int(h), int(w)) for f, h, w in shapes)
    axes = tuple(int(a) for a in axes_dims)
    img = _image_angles(shapes_t, axes, float(theta))  # type: ignore[arg-type]
    txt = _text_angles(text_offset(shapes_t), int(txt_len), axes, float(theta))  # type: ignore[arg-type]
    out = []
    for ang in (img, txt):
        out.append(torch.cos(ang).to(torch.float32).to(device))
        out.append(torch.sin(ang).to(torch.float32).to(device))
    return out[0], out[1], out[2], out[3]


@functools.lru_cache(maxsize=64)
def _packed_tables(
    shapes: tuple[tuple[ImgShape, ...], ...], txt_lens: tuple[int, ...], axes: tuple[int, ...], theta: float, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    per = [rope_tables(s, n, axes, theta, "cpu") for s, n in zip(shapes, txt_lens)]
    return tuple(torch.cat([t[i] for t in per]).to(device) for i in range(4))  # type: ignore[return-value]


def packed_rope_tables(
    img_shapes: Sequence[Sequence[ImgShape]], txt_lens: Sequence[int], axes_dims: Sequence[int], theta: float,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed FP32 tables for a batch: ``(img_cos, img_sin)`` over every sample's image rows, then
    ``(txt_cos, txt_sin)`` over every sample's valid text rows, in sample order.

    Cached per (shapes, text lengths, device): a repeated batch layout reuses the device tensors, so a
    forward copies nothing from the host after its first call with that layout. The tables are shared:
    treat them as read-only.
    """
    key_shapes = tuple(tuple((int(f), int(h), int(w)) for f, h, w in s) for s in img_shapes)
    return retain(_packed_tables(key_shapes, tuple(int(n) for n in txt_lens), tuple(int(a) for a in axes_dims), float(theta), str(torch.device(device))))


def normalize_img_shapes(img_shapes: object, batch: int, tokens: int, image_padding: bool = False) -> list[list[ImgShape]]:
    """Accept every ``img_shapes`` form diffusers' Qwen-Image transformer accepts; return one list of
    ``(f, h, w)`` grids per sample.

    ``image_padding`` (an extension diffusers does not have): a sample's grids may describe fewer than
    ``T_img`` tokens; its rows after them are padding (edit batches whose conditioning images differ in
    size). Only the per-sample list-of-lists form takes it, and the longest sample must fill ``T_img``.

    ``batch`` is ``hidden_states.shape[0]`` and ``tokens`` its image-token count ``T_img``. The forms:

    * ``(f, h, w)``: one grid shared by every sample.
    * ``[[(f, h, w), ...], ...]`` (list of lists, what ``QwenImagePipeline`` passes): one grid list per
      sample when its length is ``batch``; a shorter list whose length divides ``batch`` and whose entries
      are all equal is that one grid list for every sample (the pipeline passes ``batch_size`` entries for
      ``batch_size * num_images_per_prompt`` samples; diffusers reads only the first entry).
    * ``[(f, h, w), ...]`` (flat list of triples). Diffusers reads it as one grid per sample (the form
      its first Qwen-Image pipeline passed, ``[(1, h, w)] * B``); older callers of this project used it
      for several grids shared by every sample. Token counts decide, and never both at once (``T_img > 0``):

      1. every triple describes ``T_img`` tokens and there are ``batch`` of them → one grid per sample;
      2. the triples together describe ``T_img`` tokens → one multi-grid list shared by every sample;
      3. all triples are equal, each describes ``T_img`` tokens and their number divides ``batch`` →
         that grid for every sample, as diffusers does (``num_images_per_prompt > 1``);
      4. anything else is a ValueError naming the counts.

    Unlike diffusers, which uses the first sample's grids for the whole batch (with a warning),
    per-sample grids that differ are honoured sample by sample.
    """
    if img_shapes is None:
        raise ValueError("img_shapes is required: one (frame, height, width) latent grid per sample")

    def is_triple(o: object) -> bool:
        return (
            isinstance(o, (tuple, list)) and len(o) == 3
            and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and int(v) > 0 for v in o)
        )

    def grid_list(o: object) -> bool:
        return isinstance(o, (list, tuple)) and len(o) > 0 and all(is_triple(t) for t in o)

    def count(shapes: Sequence[Sequence[int]]) -> int:
        return sum(int(f) * int(h) * int(w) for f, h, w in shapes)

    def canon(shapes: Sequence[Sequence[int]]) -> list[ImgShape]:
        return [(int(f), int(h), int(w)) for f, h, w in shapes]

    per: list[list[ImgShape]]
    if is_triple(img_shapes):
        per = [canon([img_shapes])] * batch  # type: ignore[list-item]
    elif grid_list(img_shapes):
        flat = canon(img_shapes)  # type: ignore[arg-type]
        each = [f * h * w for f, h, w in flat]
        if len(flat) == batch and all(n == tokens for n in each):
            per = [[t] for t in flat]
        elif sum(each) == tokens:
            per = [flat] * batch
        elif batch % len(flat) == 0 and all(t == flat[0] for t in flat) and each[0] == tokens:
            per = [[flat[0]]] * batch
        else:
            raise ValueError(
                f"img_shapes {list(img_shapes)!r} fits neither reading of a flat list of (f, h, w): one grid per "  # type: ignore[call-overload]
                f"sample needs {batch} triples of {tokens} tokens each (got {len(flat)} triples of {each} tokens); "
                f"grids shared by every sample need {tokens} tokens together (got {sum(each)})"
            )
    elif isinstance(img_shapes, (list, tuple)) and len(img_shapes) > 0 and all(grid_list(s) for s in img_shapes):
        lists = [canon(s) for s in img_shapes]
        if len(lists) == batch:
            per = lists
        elif batch % len(lists) == 0 and all(s == lists[0] for s in lists):
            per = [lists[0]] * batch
        else:
            raise ValueError(
                f"img_shapes holds {len(lists)} grid lists for a batch of {batch}: pass one list of (f, h, w) per sample "
                f"(or equal lists whose number divides the batch, which are shared)"
            )
    else:
        raise ValueError(
            "img_shapes must be (f, h, w), a list of (f, h, w) or a list of such lists (one per sample) with positive "
            f"integer sizes (batch {batch}); got {img_shapes!r}"
        )
    if image_padding:
        if not (isinstance(img_shapes, (list, tuple)) and len(img_shapes) == batch and all(grid_list(s) for s in img_shapes)):
            raise ValueError(f"image_padding=True needs img_shapes as one list of (f, h, w) grids per sample ({batch} lists)")
        counts = [count(s) for s in per]
        over = [(b, n) for b, n in enumerate(counts) if n > tokens]
        if over:
            raise ValueError(f"img_shapes of sample {over[0][0]} describe {over[0][1]} tokens but hidden_states has only {tokens} image tokens")
        if max(counts) != tokens:
            raise ValueError(f"image_padding=True: the longest sample describes {max(counts)} tokens, hidden_states has {tokens} "
                             "image tokens (pad to the longest sample, no further)")
        return per
    for b, shapes in enumerate(per):
        n = count(shapes)
        if n != tokens:
            raise ValueError(f"img_shapes of sample {b} describe {n} tokens but hidden_states has {tokens} image tokens")
    return per

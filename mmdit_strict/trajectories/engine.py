"""One denoising step's velocity for a batch of samples: model forwards + CFG combine.

This is the only place rollout and recompute touch the model, so both sides differ only in what
the config lets them differ in: runtime mode, batch composition, CFG layout, padding, autograd.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import time
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch

from ..kernels.execution import current, current_runtime
from ..kernels.grad_sink import sample_keys
from ..kernels.runtime import Runtime
from ..kernels.trace import record
from ..model import MMDiT
from ..model.edit import SampleConditioning, edit_batch
from ..model.strict import observe_operator
from ..sampling import SDEStepResult, cfg_combine
from .hashing import tensor_sha256

#: Where a side's time goes (seconds): the transformer forwards (and the recompute's backward), CFG
#: combine, and the scheduler (sigma table, noise, SDE step and logp).
TIME_PARTS = ("model", "cfg", "scheduler")
_SPLIT: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("mmdit_time_split", default=None)


@contextlib.contextmanager
def time_split() -> Iterator[dict[str, float]]:
    """Accumulate, inside the block, the seconds spent in each of :data:`TIME_PARTS` (CUDA work synced)."""
    split = {k: 0.0 for k in TIME_PARTS}
    token = _SPLIT.set(split)
    try:
        yield split
    finally:
        _SPLIT.reset(token)


@contextlib.contextmanager
def timed(part: str, device: torch.device | None = None) -> Iterator[None]:
    """Count the block's wall time to ``part`` of the active :func:`time_split` (nothing when none is active)."""
    split = _SPLIT.get()
    if split is None:
        yield
        return
    sync = device is not None and device.type == "cuda"
    if sync:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if sync:
            torch.cuda.synchronize(device)
        split[part] += time.perf_counter() - t0


@functools.lru_cache(maxsize=None)
def _sampling_impl(op: str, device: str) -> Any:
    from ..kernels.registry import implementations

    return next((i for i in implementations(op) if i.device == device), None)


def sampling_op(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """One sampling operator ``fn(*args, **kwargs)`` as the model's operators run: through the side's
    perturbation overlay, recorded in the operator trace (when ``name`` is a registered operator) and
    seen by operator capture / fault injection under the key ``sampling.<name>``."""
    overlay = current().overlay
    out = overlay.call(name, "sampling", fn, args, kwargs) if overlay is not None else fn(*args, **kwargs)
    ref = out[0] if isinstance(out, tuple) else out
    impl = _sampling_impl(name, ref.device.type)
    if impl is not None:
        record(name, impl, current_runtime(), ref.device.type, ref.dtype, False)
    seen = observe_operator(name, "sampling", out)
    return SDEStepResult(*seen) if isinstance(out, SDEStepResult) else seen


def pad_prompts(rows: Sequence[torch.Tensor], pad_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts ``(L_i, C)`` → zero-padded ``(B, L, C)`` (``L`` = ``pad_to`` or the longest) and the prefix mask ``(B, L)``."""
    L = max(r.shape[0] for r in rows)
    if pad_to is not None:
        if pad_to < L:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest prompt ({L} tokens)")
        L = pad_to
    C = rows[0].shape[1]
    out = rows[0].new_zeros(len(rows), L, C)
    mask = torch.zeros(len(rows), L, dtype=torch.long, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
        mask[i, : r.shape[0]] = 1
    return out, mask


def velocity(
    model: MMDiT,
    x: torch.Tensor,  # (B, T, 64) in the model dtype
    cond: Sequence[torch.Tensor],  # B prompts, each (L_i, C)
    neg: torch.Tensor | Sequence[torch.Tensor],  # (L_neg, C) shared, or one per sample (edit: each sample's own)
    sigma: float | Sequence[float],
    grid: tuple[int, int],
    cfg_scale: float,
    cfg_layout: str,
    pad_to: int | None = None,
    block_hashes: list[list[str]] | None = None,
    sample_ids: Sequence[Hashable] | None = None,
    images: Sequence[SampleConditioning] | None = None,
) -> torch.Tensor:
    """CFG-combined velocity ``(B, T, 64)`` in FP32; ``sigma`` is one value for the batch or one per sample.

    ``neg`` is the negative prompt every sample shares, or one per sample (an edit checkpoint's negatives
    encoded with each sample's own images).

    ``images`` (edit conditioning, one per sample: an input image or several): each sample's input-image latents ride behind its
    noisy latents in both CFG branches (``model.edit``); the velocity is the noisy tokens' rows.

    In ``audit`` runtime, ``block_hashes`` (if given) receives, per sample of the conditional
    branch, the sha256 of every block's image-stream output rows. ``sample_ids`` labels each sample's
    rows as ``(sample_id, branch)`` (0 = cond, 1 = neg) for split-invariant gradient folding (any
    hashable label: the trainer labels (sample, step) pairs).
    """
    B = x.shape[0]
    shapes = [[(1, grid[0], grid[1])]] * B
    negs = [neg] * B if isinstance(neg, torch.Tensor) else list(neg)
    if len(negs) != B:
        raise ValueError(f"per-sample negative prompts need one per sample: {B} samples, {len(negs)} negatives")
    if images is not None and len(images) != B:
        raise ValueError(f"edit conditioning needs one image per sample: {B} samples, {len(images)} images")

    ids = list(sample_ids) if sample_ids is not None else list(range(B))
    per_sample = None if isinstance(sigma, (int, float)) else torch.tensor([float(s) for s in sigma], dtype=torch.float32,
                                                                           device=x.device)

    def forward(xs: torch.Tensor, prompts: Sequence[torch.Tensor], branches: Sequence[int]) -> torch.Tensor:
        ehs, mask = pad_prompts(prompts, pad_to)
        n = xs.shape[0]
        t = torch.full((n,), sigma, dtype=torch.float32, device=xs.device) if per_sample is None \
            else per_sample.repeat(len(branches))
        keys = [(i, br) for br in branches for i in ids]
        with sample_keys(keys), timed("model", xs.device):
            if images is None:
                return model(xs, ehs, mask, t, [shapes[0]] * n, return_dict=False)[0]
            eb = edit_batch(xs, list(images) * len(branches), grid)
            out = model(eb.hidden_states, ehs, mask, t, eb.img_shapes, return_dict=False, image_padding=eb.image_padding)[0]
            return eb.velocity(out)

    def collect_blocks() -> None:
        # the last forward's strict block outputs: each sample's image rows (noisy, then conditioning) in order
        if block_hashes is None or model.runtime is not Runtime.AUDIT or model.last_block_capture is None:
            return
        cap, T = model.last_block_capture, x.shape[1]
        lens = [T] * B if images is None else [T + im.tokens for im in images]
        for j in range(B):
            start = sum(lens[:j])
            block_hashes.append([tensor_sha256(cap[f"block{i}.img"][start:start + lens[j]])
                                 for i in range(model.config.num_layers)])

    if cfg_scale == 1.0:
        v = forward(x, cond, (0,)).float()
        collect_blocks()
        return v
    mp = current().parallel
    if mp is not None and mp.cfg == 2:  # CFG-parallel: this rank's branch, then both branches on every rank
        from ..parallel.exchange import replicated_branches

        mine = forward(x, cond if mp.cfg_rank == 0 else negs, (mp.cfg_rank,))
        collect_blocks()
        v_cond, v_neg = (v.float() for v in replicated_branches(mp, mine))
    elif cfg_layout == "batched":
        both = forward(torch.cat([x, x]), list(cond) + negs, (0, 1)).float()
        collect_blocks()
        v_cond, v_neg = both[:B], both[B:]
    elif cfg_layout == "sequential":
        v_cond = forward(x, cond, (0,)).float()
        collect_blocks()
        v_neg = forward(x, negs, (1,)).float()
    else:
        raise ValueError(f"cfg_layout must be 'batched' or 'sequential', got {cfg_layout!r}")
    with timed("cfg", x.device):
        return sampling_op("cfg_combine_renorm", cfg_combine, v_cond, v_neg, float(cfg_scale))

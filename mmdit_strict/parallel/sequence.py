"""The sharded strict forward: each rank of a model group computes its shard of every sample's image rows
(sequence parallelism) and, under tensor parallelism, its column shard of every block product
(:mod:`.tensor`).

Forward (every operator is row-local and batch-invariant, so a row's bytes do not depend on which rows
share its call): the image rows of sample ``b`` are cut into ``sp`` contiguous shards
(:func:`~mmdit_strict.parallel.layout.row_shards`) with their RoPE rows; text rows, the timestep
embedding and the per-sample modulation are computed whole on every rank (replicated, identical bytes).
Joint attention meets the whole sequence by Ulysses (``parallel.attention=ulysses``): an all-to-all turns
(my rows, every head) into (every row, my heads) for image Q/K/V, the text Q/K/V keep my heads, the
one-rank attention operator runs on those heads, and the inverse all-to-all (image) and a head gather
(text) bring the outputs back; attention is per head, so its bytes are the one-rank call's. Or by
gathering K/V (``allgather``): every rank gathers the image K and V rows and the attention operator runs
this rank's query rows against the whole samples' keys (queries are row-local; checked once per shape). After the last block, the output rows are
gathered in packed order on every rank.

Backward (autograd on): a block's backward is the one-rank block's backward, recomputed on the gathered
whole rows on every rank of the group (:class:`ShardedBlock`): weight gradients reduce over a sample's
rows, and a shard of that reduction summed across ranks would not be the one-rank bytes. So the
backward is exact and replicated, not sharded (docs/parallel.md, "What is sharded").
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from ..kernels.execution import in_context
from ..model.rope import packed_rope_tables
from ..model.strict import (_gemm, _op, block_forward, instrumented, pack_images, project_out, text_rows, time_embedding,
                            unpack_images)
from .exchange import RowLayout, gather_heads, gather_rows, heads_to_rows, replicated_rows, rows_to_heads
from .groups import ModelParallel
from .layout import packed_rows, row_shards


def ulysses(mp: ModelParallel, rows: RowLayout, heads: int, tseq: tuple[int, ...], iseq_full: tuple[int, ...]) -> Callable[..., Any]:
    """The ``attend`` of :func:`~mmdit_strict.model.strict.block_forward` for this rank's row shard; ``heads``:
    the heads this rank's block computes (all of them, or its tensor rank's ``heads / tp``)."""
    h = heads // mp.sp
    mine = slice(mp.sp_rank * h, (mp.sp_rank + 1) * h)

    def attend(i: int, qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor,
               vi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qh, kh, vh = (rows_to_heads(mp, t, rows) for t in (qi, ki, vi))
        qt, kt, vt = (t[:, mine].contiguous() for t in (qt, kt, vt))
        ot, oi = _op("joint_attention_fused", f"block{i}.joint", qh, qt, kt, vt, qh, kh, vh,
                     txt_seqlens=tseq, img_seqlens=iseq_full)
        return gather_heads(mp, ot, heads), heads_to_rows(mp, oi, rows, heads)

    return attend


def allgather(mp: ModelParallel, rows: RowLayout, tseq: tuple[int, ...], iseq_full: tuple[int, ...],
              iseq: tuple[int, ...], head_shape: tuple[int, int], dtype: torch.dtype,
              device: torch.device) -> Callable[..., Any]:
    """The ``attend`` of :func:`~mmdit_strict.model.strict.block_forward` that gathers every rank's image K and V
    rows and attends with this rank's query rows only (``parallel.attention=allgather``). Text rows are whole on
    every rank, so every rank also computes the text queries (identical bytes; nothing to gather back).
    ``head_shape``: ``(heads, head_dim)`` of this rank's attention calls."""
    from ..kernels.execution import Runtime, current_runtime

    if current_runtime() is Runtime.OFF:
        raise ValueError("parallel.attention=allgather needs the strict attention operator (query-row subsets): "
                         "use parallel.attention=ulysses on a runtime=off side")
    _check_query_subsets(tseq, iseq_full, iseq, rows.local[mp.sp_rank], head_shape, dtype, device)

    def attend(i: int, qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor,
               vi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_all, v_all = gather_rows(mp, ki, rows), gather_rows(mp, vi, rows)
        return _op("joint_attention_fused", f"block{i}.joint", qi, qt, kt, vt, qi, k_all, v_all, txt_seqlens=tseq,
                   img_seqlens=iseq_full, query_img_seqlens=iseq)

    return attend


_SUBSETS_CHECKED: dict[tuple, bool] = {}


def _check_query_subsets(tseq: tuple[int, ...], iseq_full: tuple[int, ...], iseq: tuple[int, ...], mine: list[int],
                         head_shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> None:
    """Refuse (ValueError) when the attention in force gives this rank's query rows (``mine``, packed indices;
    ``iseq`` of them per sample) other bytes than the whole call does: one probe per shape on random rows (the
    same call pattern as the batch), every row compared."""
    key = (tseq, iseq_full, tuple(mine), head_shape, dtype, device.type)
    ok = _SUBSETS_CHECKED.get(key)
    if ok is None:
        from ..kernels.execution import bind, current

        g = torch.Generator().manual_seed(len(mine) * 131 + sum(iseq_full))
        make = lambda n: torch.randn(n, *head_shape, generator=g).to(device, dtype)  # noqa: E731
        t = [make(sum(tseq)) for _ in range(3)]
        q, k, v = (make(sum(iseq_full)) for _ in range(3))
        idx = torch.tensor(mine, dtype=torch.long, device=device)
        quiet = current().replace(trace=None, capture=None, fault=None, overlay=None, gemm_calls=None)
        with torch.no_grad(), bind(quiet):
            ot, oi = _op("joint_attention_fused", "sp_probe", q, t[0], t[1], t[2], q, k, v, txt_seqlens=tseq,
                         img_seqlens=iseq_full)
            st, si = _op("joint_attention_fused", "sp_probe", q, t[0], t[1], t[2], q.index_select(0, idx).contiguous(),
                         k, v, txt_seqlens=tseq, img_seqlens=iseq_full, query_img_seqlens=iseq)
        ok = _SUBSETS_CHECKED[key] = torch.equal(st, ot) and torch.equal(si, oi.index_select(0, idx))
    if not ok:
        raise ValueError("parallel.attention=allgather: this platform's joint attention gives a rank's query rows other "
                         "bytes than the whole call; use parallel.attention=ulysses")


class ShardedBlock(torch.autograd.Function):
    """One block on this rank's image rows; its backward is the one-rank block's on the gathered rows.

    ``anchor`` is an empty tensor that requires grad, so the block's LoRA parameters get gradients even
    where no input does (block 0)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, img: torch.Tensor, txt: torch.Tensor, temb: torch.Tensor,  # type: ignore[override]
                local: Callable[..., Any], whole: Callable[..., Any], mp: ModelParallel, rows: RowLayout):
        ctx.save_for_backward(img, txt, temb)
        ctx.set_materialize_grads(False)  # an unused output (the last block's text rows) gets None, not zeros
        ctx.whole, ctx.mp, ctx.rows = whole, mp, rows
        with torch.no_grad():
            return local(img, txt, temb)

    @staticmethod
    def backward(ctx, d_img: torch.Tensor | None, d_txt: torch.Tensor | None):  # type: ignore[override]
        img, txt, temb = ctx.saved_tensors
        mp, rows = ctx.mp, ctx.rows
        full = gather_rows(mp, img, rows)
        d_full = gather_rows(mp, d_img.contiguous(), rows) if d_img is not None else None
        with torch.enable_grad():
            a = full.detach().requires_grad_(ctx.needs_input_grad[1])
            t = txt.detach().requires_grad_(ctx.needs_input_grad[2])
            e = temb.detach().requires_grad_(ctx.needs_input_grad[3])
            out_img, out_txt = ctx.whole(a, t, e)
            pairs = [(o, g) for o, g in ((out_img, d_full), (out_txt, d_txt)) if g is not None and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        d_a = rows.part(a.grad, mp.sp_rank) if a.grad is not None else None
        return None, d_a, t.grad, e.grad, None, None, None, None


def sharded_forward(mp: ModelParallel, model: Any, inputs: Any,
                    block_capture: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The strict forward with this rank computing its image-row shard (``sp``) and its column shard of every
    block product (``tp``, :class:`~.tensor.ColumnShards`); returns the whole ``(B, T_img, out)`` on every
    rank of the model group (same bytes as one rank)."""
    if instrumented():
        raise ValueError("operator capture, fault injection and perturbations run on one rank per sample: "
                         "use a side without sequence or tensor parallelism (parallel.sp=1, parallel.tp=1) for them")
    cfg = model.config
    heads, head_dim, eps = cfg.num_attention_heads, cfg.attention_head_dim, cfg.eps
    mp.layout.check(mp.world, heads)
    x = inputs.hidden_states
    B, Ti, _ = x.shape
    lengths = list(inputs.img_lens)  # each sample's valid image rows (edit batches may mix sizes)
    k = mp.sp_rank
    rows = RowLayout([packed_rows(lengths, mp.sp, r) for r in range(mp.sp)], sum(lengths), x.device)
    iseq_full = tuple(lengths)
    iseq = tuple(b - a for a, b in row_shards(lengths, mp.sp)[k])
    columns = mp.column_shards() if mp.tp > 1 else None

    img_cos, img_sin, txt_cos, txt_sin = packed_rope_tables(inputs.img_shapes, inputs.txt_lens, cfg.axes_dims_rope,
                                                            cfg.rope_theta, x.device)
    rope_full = (img_cos, img_sin, txt_cos, txt_sin)
    rope = rope_full if mp.sp == 1 else (rows.part(img_cos, k), rows.part(img_sin, k), txt_cos, txt_sin)
    temb = time_embedding(model, inputs)
    packed = pack_images(x, lengths)
    img = _gemm("latent_proj_gemm", "img_in", packed if mp.sp == 1 else rows.part(packed, k), model.img_in, iseq)
    txt, tseq = text_rows(model, inputs)
    attend = None
    if mp.sp > 1:
        attend = (ulysses(mp, rows, heads // mp.tp, tseq, iseq_full) if mp.layout.attention == "ulysses"
                  else allgather(mp, rows, tseq, iseq_full, iseq, (heads // mp.tp, head_dim), x.dtype, x.device))

    grad = torch.is_grad_enabled()
    for i, block in enumerate(model.transformer_blocks):
        local = functools.partial(_local_block, i, block, rope, iseq, tseq, heads, head_dim, eps, attend, columns)
        if grad:
            whole = in_context(functools.partial(_local_block, i, block, rope_full, iseq_full, tseq, heads, head_dim, eps,
                                                 None, None))
            anchor = _anchor(block, x.device)
            img, txt = ShardedBlock.apply(anchor, img, txt, temb, in_context(local), whole, mp, rows)
        else:
            img, txt = local(img, txt, temb)
        if block_capture is not None:
            block_capture[f"block{i}.img"] = gather_rows(mp, img.detach(), rows)
            block_capture[f"block{i}.txt"] = txt.detach()
    out = project_out(model, img, temb, iseq)
    return unpack_images(replicated_rows(mp, out, rows), lengths, Ti)


def _local_block(i: int, block: Any, rope: tuple, iseq: tuple, tseq: tuple, heads: int, head_dim: int, eps: float,
                 attend: Any, columns: Any, img: torch.Tensor, txt: torch.Tensor,
                 temb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return block_forward(i, block, img, txt, temb, rope, iseq, tseq, heads, head_dim, eps, attend=attend, columns=columns)


def _anchor(block: Any, device: torch.device) -> torch.Tensor:
    needs = any(p.requires_grad for p in block.parameters())
    return torch.empty(0, device=device, requires_grad=needs)


__all__ = ["ShardedBlock", "allgather", "sharded_forward", "ulysses"]

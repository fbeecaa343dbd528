"""The strict forward: the MMDiT composed only of registry operators, on packed rows.

Padding never enters: each sample's valid text rows and its image rows are packed, every operator
sees ``seqlens``, and per-sample vectors (timestep embedding, modulation) are ``(B, D)``. The same
parameters as the production forward are read; LoRA layers (PEFT) are applied unmerged through the
GEMM operators' ``lora`` argument.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
import torch.utils.checkpoint
from torch import nn

from ..kernels.execution import bind, current, current_runtime, in_context
from ..kernels.kept_outputs import KeptOutputs
from ..kernels.prologues import shared_prologues
from ..kernels.registry import dispatch, resolve
from ..kernels.trace import record
from ..kernels.streams import gemm_stream
from .rope import packed_rope_tables

if TYPE_CHECKING:
    from .mmdit import MMDiT, ModelInputs


@dataclass(frozen=True)
class GemmCall:
    """One product the strict forward hands to the GEMM engine: ``rows × k`` input, ``(n, k)`` weight."""

    op: str  # the operator that runs it (a GEMM-family op, or a fused op around the engine)
    where: str  # e.g. "block0.img", "txt_in", "temb_1"
    rows: int
    n: int
    k: int
    bias: bool
    prologue: str = "none"
    epilogue: str = "none"


@contextlib.contextmanager
def record_gemms() -> Iterator[list[GemmCall]]:
    """List every GEMM the strict forwards inside the block run (shapes only; nothing else changes): the
    ``gemm_calls`` field of the execution context."""
    calls: list[GemmCall] = []
    with bind(current().replace(gemm_calls=calls)):
        yield calls


def _note_gemm(op: str, where: str, rows: int, weight: torch.Tensor, bias: torch.Tensor | None,
               prologue: str = "none", epilogue: str = "none") -> None:
    log = current().gemm_calls
    if log is not None:
        log.append(GemmCall(op, where, int(rows), int(weight.shape[0]), int(weight.shape[1]), bias is not None,
                            prologue, epilogue))


@contextlib.contextmanager
def inject_fault(key: str | None) -> Iterator[None]:
    """Perturb the first element of operator output ``key`` (e.g. ``block1.img.mlp_down_gemm``; ``key#R``: the
    first element of its row ``R``, rows counted as the output holds them, packed samples back to back) by
    ``max(2⁻¹⁰, 2·eps)·max(|x|, 1)``, ``eps`` of the output's dtype (2⁻¹⁰ in FP32; 2⁻⁶ in BF16, where
    2⁻¹⁰ is under half an ULP and would round away).

    (A one-ULP bump is usually absorbed by the next rounding and never reaches v_t.)

    A deliberate, known mismatch: it validates that compare/localize name the right step, block and
    operator. ``None`` does nothing. The ``fault`` field of the execution context.
    """
    with bind(current().replace(fault=key)):
        yield


def _bump(out: torch.Tensor, row: int = 0) -> torch.Tensor:
    rows = out.shape[0] if out.dim() > 1 else 1
    if not 0 <= row < rows:
        raise ValueError(f"the planted fault names row {row} but the operator output has {rows} rows")
    at = row * (out.numel() // rows)
    first = out.detach().reshape(-1)[at:at + 1]
    bump = torch.zeros_like(out)
    bump.view(-1)[at:at + 1] = first.abs().clamp_min(1.0) * max(2.0**-10, 2 * torch.finfo(out.dtype).eps)
    return out + bump


@contextlib.contextmanager
def capture_operators() -> Iterator[dict[str, torch.Tensor]]:
    """Record every operator output of forwards in the block: ``{"block3.img.mlp_up_gemm_gelu": (M, N)}``.

    Strict forwards record packed rows; the production forward (runtime ``off``) records its padded
    ``(B, T, ...)`` tensors (per-sample vectors ``(B, ...)`` in both), under the same keys. The ``capture``
    field of the execution context."""
    store: dict[str, torch.Tensor] = {}
    with bind(current().replace(capture=store)):
        yield store


@contextlib.contextmanager
def uninstrumented() -> Iterator[None]:
    """Neither capture, fault injection nor an overlay inside the block (audit's side run of the production forward)."""
    with bind(current().replace(capture=None, fault=None, overlay=None)):
        yield


def _op(name: str, where: str, ref: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    overlay = current().overlay
    if overlay is not None:  # an ablation probe on this side (mmdit_strict.overlay): it may replace the call
        return observe_operator(name, where, overlay.call(
            name, where, lambda *a, **k: dispatch(name, ref.device, ref.dtype, *a, **k), args, kwargs))
    return observe_operator(name, where, dispatch(name, ref.device, ref.dtype, *args, **kwargs))


def observe_operator(name: str, where: str, out: Any) -> Any:
    """The capture / fault hook every operator call of a forward passes its output through (strict and
    production alike): plants the fault named ``{where}.{name}`` and records the output under that key."""
    ctx = current()
    fault = ctx.fault
    if fault is not None:
        fkey, _, frow = fault.partition("#")
        if fkey == f"{where}.{name}":
            row = int(frow) if frow else 0
            out = tuple(_bump(o, row) for o in out) if isinstance(out, tuple) else _bump(out, row)
    store = ctx.capture
    if store is not None:
        key = f"{where}.{name}"
        if isinstance(out, tuple):
            for i, o in enumerate(out):
                store[f"{key}.{i}"] = o.detach().clone()
        else:
            store[key] = out.detach().clone()
    return out


def instrumented() -> bool:
    """True while operator capture, fault injection or a perturbation overlay is active (a CUDA graph or a
    fused kernel would hide them)."""
    ctx = current()
    return ctx.capture is not None or ctx.fault is not None or ctx.overlay is not None


def _fusion(first: str, second: str, ref: torch.Tensor) -> Callable[..., Any] | None:
    """The fused kernel for ``second(first(...))`` when both resolve to one backend offering it, else None.

    Never while operators are captured or a fault is planted (the localizer needs both outputs; the fused
    kernel gives the pair's bytes, so results do not change). Both operators are recorded in the trace.
    """
    if instrumented():
        return None
    runtime = current_runtime()
    a, a_fell = resolve(first, ref.device, ref.dtype, runtime)
    fn = a.fusions.get(second)
    if fn is None:
        return None
    b, b_fell = resolve(second, ref.device, ref.dtype, runtime)
    if b.backend != a.backend:
        return None
    record(first, a, runtime, ref.device.type, ref.dtype, a_fell)
    record(second, b, runtime, ref.device.type, ref.dtype, b_fell)
    return fn


def linear_params(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
    """(weight, bias, lora) of a plain ``nn.Linear`` or a PEFT LoRA-wrapped one (active adapters, unmerged)."""
    base = getattr(module, "base_layer", None)
    if base is None:
        return module.weight, module.bias, None
    if getattr(module, "merged", False):
        raise RuntimeError("strict mode never merges LoRA into base weights: unmerge the adapter first")
    if getattr(module, "disable_adapters", False):  # PEFT's enable_adapters(False): the base layer alone
        return base.weight, base.bias, None
    lora = None
    for name in getattr(module, "active_adapters", []):
        if name in getattr(module, "lora_A", {}):
            if lora is not None:
                raise NotImplementedError("strict mode supports one active LoRA adapter per layer")
            if getattr(module, "use_dora", {}).get(name, False):
                raise NotImplementedError("DoRA adapters are not supported in strict mode")
            lora = (module.lora_A[name].weight, module.lora_B[name].weight, float(module.scaling[name]))
    return base.weight, base.bias, lora


def _gemm(op: str, where: str, x: torch.Tensor, module: nn.Module, seqlens: tuple[int, ...], stream: str = "image",
          **kw: Any) -> torch.Tensor:
    """One GEMM-family operator on ``module``'s weights; ``stream`` ("image" | "text") picks the engine's tile
    for that stream (same bytes, see kernels.streams)."""
    w, b, lora = linear_params(module)
    return gemm_params(op, where, x, w, b, lora, seqlens, stream, **kw)


def gemm_params(op: str, where: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, lora: tuple | None,
                seqlens: tuple[int, ...], stream: str = "image", **kw: Any) -> torch.Tensor:
    """One GEMM-family operator on explicit ``(weight, bias, lora)`` (a layer's, or a column shard of them)."""
    _note_gemm(op, where, x.shape[0], w, b, kw.get("prologue", "none"), kw.get("epilogue", "none"))
    with gemm_stream(stream):
        return _op(op, where, x, x, w, b, seqlens=seqlens, lora=lora, **kw)


Modulation = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]


def block_modulation(i: int, block: nn.Module, temb: torch.Tensor) -> Modulation:
    """Block ``i``'s per-sample modulation vectors, image then text: the six ``(B, D)`` column chunks
    (shift, scale, gate) × (attention, MLP) of each stream's ``(B, 6D)`` product ``SiLU(temb) Wᵀ + b``.

    The chunks stay views with row stride 6D (every row operator reads per-sample vectors with a free row
    stride, so no copy is launched). They read nothing but ``temb``."""
    ones = (1,) * temb.shape[0]
    imod = _gemm("adaln_mod_projection", f"block{i}.img", temb, block.img_mod[1], ones, prologue="silu").chunk(6, dim=-1)
    tmod = _gemm("adaln_mod_projection", f"block{i}.txt", temb, block.txt_mod[1], ones, "text",
                 prologue="silu").chunk(6, dim=-1)
    return imod, tmod


def block_forward(
    i: int, block: nn.Module, img: torch.Tensor, txt: torch.Tensor, temb: torch.Tensor,
    rope: tuple[torch.Tensor, ...], iseq: tuple[int, ...], tseq: tuple[int, ...], heads: int, head_dim: int, eps: float,
    attend: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None, columns: Any = None,
    modulation: Modulation | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ``i`` on packed rows. ``attend(i, qt, kt, vt, qi, ki, vi) → (ot, oi)`` replaces the joint
    attention operator call (sequence parallelism meets the whole sequence there); None calls it.
    ``columns`` (tensor parallelism, :class:`mmdit_strict.parallel.tensor.ColumnShards`): Q/K/V give this
    rank's heads (``columns.local``), attention runs on them, their outputs are gathered
    (``columns.gather``) and the other block products are whole on every rank (``columns.whole``).
    ``modulation``: :func:`block_modulation` of this block and ``temb`` computed by the caller (outside a
    gradient checkpoint, so the recompute skips it), or None to compute it here first."""
    qkv, proj = (_gemm, _gemm) if columns is None else (columns.local, columns.whole)
    if columns is not None:
        heads //= columns.size
    img_cos, img_sin, txt_cos, txt_sin = rope
    wi, wt = f"block{i}.img", f"block{i}.txt"
    imod, tmod = block_modulation(i, block, temb) if modulation is None else modulation

    hi = _op("adaln_modulation", wi, img, img, imod[0], imod[1], seqlens=iseq, eps=eps)
    ht = _op("adaln_modulation", wt, txt, txt, tmod[0], tmod[1], seqlens=tseq, eps=eps)
    a = block.attn

    def heads_of(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], heads, head_dim)

    def qk(where: str, h: torch.Tensor, proj: nn.Module, norm: nn.Module, cos: torch.Tensor, sin: torch.Tensor,
           seq: tuple[int, ...], stream: str) -> torch.Tensor:
        t = heads_of(qkv("qkv_bias_gemm", where, h, proj, seq, stream))
        if columns is not None:  # the norm + RoPE kernels tile a token's heads by the head count: run them on all
            t = columns.spread_heads(t)
        fused = _fusion("qk_rmsnorm", "multi_axis_rope", t)
        if fused is not None:
            t = fused(t, norm.weight, cos, sin, seqlens=seq, eps=eps)
        else:
            t = _op("qk_rmsnorm", where, t, t, norm.weight, seqlens=seq, eps=eps)
            t = _op("multi_axis_rope", where, t, t, cos, sin)
        return t if columns is None else columns.own_heads(t)

    qi = qk(wi + ".q", hi, a.to_q, a.norm_q, img_cos, img_sin, iseq, "image")
    ki = qk(wi + ".k", hi, a.to_k, a.norm_k, img_cos, img_sin, iseq, "image")
    vi = heads_of(qkv("qkv_bias_gemm", wi + ".v", hi, a.to_v, iseq))
    qt = qk(wt + ".q", ht, a.add_q_proj, a.norm_added_q, txt_cos, txt_sin, tseq, "text")
    kt = qk(wt + ".k", ht, a.add_k_proj, a.norm_added_k, txt_cos, txt_sin, tseq, "text")
    vt = heads_of(qkv("qkv_bias_gemm", wt + ".v", ht, a.add_v_proj, tseq, "text"))
    if attend is None:
        kept = current().kept_outputs  # checkpointed: the forward's attention outputs serve its recompute
        with kept.at(f"block{i}.joint") if kept is not None else contextlib.nullcontext():
            ot, oi = _op("joint_attention_fused", f"block{i}.joint", qi, qt, kt, vt, qi, ki, vi, txt_seqlens=tseq,
                         img_seqlens=iseq)
    else:
        ot, oi = attend(i, qt, kt, vt, qi, ki, vi)
    if columns is not None:
        ot, oi = columns.gather(ot), columns.gather(oi)

    def gated(op: str, where: str, part: str, x: torch.Tensor, h: torch.Tensor, module: nn.Module, gate: torch.Tensor,
              seq: tuple[int, ...], stream: str) -> torch.Tensor:
        """``adaln_gate_residual(x, op(h), gate)``; through the product's fused epilogue where the backend offers one
        (no gradient and no column shards: the fused kernel never writes the product's own output)."""
        if columns is None and not torch.is_grad_enabled():
            fused = _fusion(op, "adaln_gate_residual", h)
            if fused is not None:
                w, b, lora = linear_params(module)
                _note_gemm(op, where, h.shape[0], w, b)
                with gemm_stream(stream):
                    return fused(h, w, b, x, gate, seqlens=seq, lora=lora)
        return _op("adaln_gate_residual", f"{where}.{part}", x, x, proj(op, where, h, module, seq, stream), gate,
                   seqlens=seq)

    img = gated("attn_out_bias_gemm", wi, "attn", img, oi, a.to_out[0], imod[2], iseq, "image")
    txt = gated("attn_out_bias_gemm", wt, "attn", txt, ot, a.to_add_out, tmod[2], tseq, "text")

    def mlp(where: str, x: torch.Tensor, mods: list, ff: nn.Module, seq: tuple[int, ...], stream: str) -> torch.Tensor:
        h = _op("adaln_modulation", where + ".mlp", x, x, mods[3], mods[4], seqlens=seq, eps=eps)
        u = proj("mlp_up_gemm_gelu", where, h, ff.net[0].proj, seq, stream, epilogue="gelu_tanh")
        return gated("mlp_down_gemm", where, "mlp", x, u, ff.net[2], mods[5], seq, stream)

    img = mlp(wi, img, imod, block.img_mlp, iseq, "image")
    txt = mlp(wt, txt, tmod, block.txt_mlp, tseq, "text")
    return img, txt


def checkpointed(fn: Callable[..., Any], *args: Any, preserve_rng: bool = True) -> Any:
    """``fn(*args)`` under gradient checkpointing (non-reentrant): its recompute during backward runs in the
    execution context in force now, whatever context the backward runs in. ``preserve_rng=False`` where
    ``fn`` draws no random numbers: the strict blocks (reading the CUDA generator's state is not allowed
    inside a CUDA graph capture, and there is nothing to restore)."""
    return torch.utils.checkpoint.checkpoint(in_context(fn), *args, use_reentrant=False, preserve_rng_state=preserve_rng)


def pack_text(ehs: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """(B, L, C) padded → (sum lens, C) valid rows, sample by sample."""
    return torch.cat([ehs[b, :n] for b, n in enumerate(lens)], dim=0)


def pack_images(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """(B, T_img, C) with trailing image padding → (sum lens, C) valid rows, sample by sample."""
    if all(n == x.shape[1] for n in lens):
        return x.reshape(-1, x.shape[-1])
    return torch.cat([x[b, :n] for b, n in enumerate(lens)], dim=0)


def unpack_images(rows: torch.Tensor, lens: list[int], tokens: int) -> torch.Tensor:
    """Inverse of :func:`pack_images`: (sum lens, C) → (B, tokens, C), padding rows zero."""
    if all(n == tokens for n in lens):
        return rows.reshape(len(lens), tokens, -1)
    out = rows.new_zeros(len(lens), tokens, rows.shape[-1])
    start = 0
    for b, n in enumerate(lens):
        out[b, :n] = rows[start:start + n]
        start += n
    return out


def time_embedding(model: "MMDiT", inputs: "ModelInputs") -> torch.Tensor:
    """The timestep embedding ``(B, D)`` (per sample; replicated under every parallel layout)."""
    cfg = model.config
    x = inputs.hidden_states
    emb = model.time_text_embed.timestep_embedder
    _note_gemm("timestep_embed_mlp", "temb_1", x.shape[0], emb.linear_1.weight, emb.linear_1.bias, epilogue="silu")
    _note_gemm("timestep_embed_mlp", "temb_2", x.shape[0], emb.linear_2.weight, emb.linear_2.bias)
    return _op("timestep_embed_mlp", "embed", x, inputs.sigma.to(torch.float32), emb.linear_1.weight, emb.linear_1.bias,
               emb.linear_2.weight, emb.linear_2.bias, channels=cfg.timestep_channels, scale=cfg.timestep_scale)


def text_rows(model: "MMDiT", inputs: "ModelInputs") -> tuple[torch.Tensor, tuple[int, ...]]:
    """The packed valid text rows after ``txt_in`` ``(sum L_b, D)`` and the text lengths (replicated under
    every parallel layout)."""
    tseq = tuple(inputs.txt_lens)
    w, b, lora = linear_params(model.txt_in)
    rows = pack_text(inputs.encoder_hidden_states, inputs.txt_lens)
    _note_gemm("txt_in_rmsnorm_linear", "txt_in", rows.shape[0], w, b)
    txt = _op("txt_in_rmsnorm_linear", "txt_in", rows, rows, model.txt_norm.weight, w, b, seqlens=tseq,
              eps=model.config.eps, lora=lora)
    return txt, tseq


def project_out(model: "MMDiT", img: torch.Tensor, temb: torch.Tensor, iseq: tuple[int, ...]) -> torch.Tensor:
    """The forward's epilogue on packed image rows: final AdaLN and ``proj_out`` → ``(rows, out)``."""
    w, b, lora = linear_params(model.norm_out.linear)
    _note_gemm("final_adaln_out", "norm_out", len(iseq), w, b, prologue="silu")
    h = _op("final_adaln_out", "norm_out", img, img, temb, w, b, seqlens=iseq, eps=model.config.eps, lora=lora)
    return _gemm("latent_proj_gemm", "proj_out", h, model.proj_out, iseq)


def strict_forward(model: "MMDiT", inputs: "ModelInputs", block_capture: dict[str, torch.Tensor] | None = None,
                   blocks: Sequence[int] | None = None) -> torch.Tensor:
    """Strict forward. Returns ``(B, T_img, out)`` in the model dtype (image padding rows, if any, zero).

    ``blocks``: run only these transformer blocks, in this order (a capture's warm-up: :mod:`.graphs`); None: all.
    Under a model-parallel layout with sequence or column shards (the execution context's ``parallel``),
    the layout runs it (``mmdit_strict.parallel``): the same bytes, each rank computing its rows / columns."""
    with shared_prologues():  # SiLU(temb) once for the forward's 2·blocks + 1 modulation products
        parallel = current().parallel
        if parallel is not None and (parallel.sp > 1 or parallel.tp > 1):
            if blocks is not None:
                raise ValueError("strict_forward: a block subset is not supported under a model-parallel layout")
            return parallel.forward(model, inputs, block_capture)
        return _strict_forward(model, inputs, block_capture, blocks)


def _strict_forward(model: "MMDiT", inputs: "ModelInputs", block_capture: dict[str, torch.Tensor] | None,
                    blocks: Sequence[int] | None = None) -> torch.Tensor:
    cfg = model.config
    x = inputs.hidden_states
    B, Ti, _ = x.shape
    iseq = tuple(inputs.img_lens)
    eps = cfg.eps

    rope = packed_rope_tables(inputs.img_shapes, inputs.txt_lens, cfg.axes_dims_rope, cfg.rope_theta, x.device)
    temb = time_embedding(model, inputs)
    img = _gemm("latent_proj_gemm", "img_in", pack_images(x, inputs.img_lens), model.img_in, iseq)
    txt, tseq = text_rows(model, inputs)

    heads, head_dim = cfg.num_attention_heads, cfg.attention_head_dim
    checkpointing = model.gradient_checkpointing and torch.is_grad_enabled()
    keep = checkpointing and model.keep_attention_outputs
    with bind(current().replace(kept_outputs=KeptOutputs())) if keep else contextlib.nullcontext():
        for i in range(len(model.transformer_blocks)) if blocks is None else blocks:
            block = model.transformer_blocks[i]
            if checkpointing:
                # the block's first operators, made just before the checkpoint: the autograd graph and its order
                # are unchanged, and the recompute skips these weight-streaming products (they read only temb)
                mod = block_modulation(i, block, temb)
                img, txt = checkpointed(block_forward, i, block, img, txt, temb, rope, iseq, tseq, heads, head_dim, eps,
                                        None, None, mod, preserve_rng=False)
            else:
                img, txt = block_forward(i, block, img, txt, temb, rope, iseq, tseq, heads, head_dim, eps)
            if block_capture is not None:
                block_capture[f"block{i}.img"] = img.detach()
                block_capture[f"block{i}.txt"] = txt.detach()
    return unpack_images(project_out(model, img, temb, iseq), inputs.img_lens, Ti)

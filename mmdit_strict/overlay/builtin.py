"""The built-in perturbations: one per factor of the RFC's ablation list, each a realistic engine mismatch.

Every hook wraps one operator call (its arguments or its output) and nothing else; ``caught_at`` is
the first operator whose output must differ. Model perturbations act on block 0 (or on the input or
embedding operators), so the first drift is the first call of the named operator.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from .registry import Overlay, Perturbation, register_perturbation


def _latent_layout(ov: Overlay, where: str, call: Callable[..., Any], args: tuple, kw: dict) -> Any:
    # the 64 packed channels as (2x2 patch, 16 channels) instead of (16 channels, 2x2 patch)
    x, *rest = args
    c = x.shape[-1]
    if c % 4:
        return call(*args, **kw)
    perm = torch.arange(c, device=x.device).reshape(c // 4, 4).t().reshape(-1)
    return call(x.index_select(-1, perm).contiguous(), *rest, **kw)


def _integer_timestep(ov: Overlay, where: str, call: Callable[..., Any], args: tuple, kw: dict) -> Any:
    # an engine that feeds integer timesteps round(1000·sigma) / 1000 instead of sigma
    sigma, *rest = args
    scale = float(kw.get("scale", 1000.0))
    return call(torch.round(sigma * scale) / scale, *rest, **kw)


def _stream_weights(ov: Overlay, where: str, call: Callable[..., Any], args: tuple, kw: dict) -> Any:
    # block 0's image MLP up-projection loaded from the text stream's set (a swapped key in a weight map)
    from ..model.strict import linear_params

    x = args[0]
    w, b, lora = linear_params(ov.model.transformer_blocks[0].txt_mlp.net[0].proj)
    if "lora" in kw:
        kw = {**kw, "lora": lora}
    return call(x, w, b, *args[3:], **kw)


def _image_first(ov: Overlay, where: str, call: Callable[..., Any], args: tuple, kw: dict) -> Any:
    # joint attention over [image, text] instead of [text, image]: the same math, another reduction order
    qt, kt, vt, qi, ki, vi = args
    oi, ot = call(qi, ki, vi, qt, kt, vt, txt_seqlens=kw["img_seqlens"], img_seqlens=kw["txt_seqlens"])
    return ot, oi


def _text_rope_offset(ov: Overlay, where: str, call: Callable[..., Any], args: tuple, kw: dict) -> Any:
    # text positions start one later (another max(h, w)/2 convention): every text angle + its frequency
    if ".txt." not in f"{where}.":
        return call(*args, **kw)
    x, cos, sin = args
    cfg = ov.model.config
    inv = torch.cat([1.0 / torch.pow(torch.tensor(float(cfg.rope_theta), dtype=torch.float64),
                                     torch.arange(0, a, 2, dtype=torch.float64) / a) for a in cfg.axes_dims_rope])
    inv = inv.to(cos.device)
    c64, s64 = cos.double(), sin.double()
    cos2 = (c64 * torch.cos(inv) - s64 * torch.sin(inv)).to(cos.dtype)
    sin2 = (s64 * torch.cos(inv) + c64 * torch.sin(inv)).to(sin.dtype)
    return call(x, cos2, sin2, **kw)


def _qk_eps(ov: Overlay, where: str, call: Callable[..., Any], args: tuple, kw: dict) -> Any:
    # Q/K RMSNorm with eps 1e-5 where the checkpoint says 1e-6
    return call(*args, **{**kw, "eps": 1e-5})


def _shift_scale_swapped(ov: Overlay, where: str, call: Callable[..., Any], args: tuple, kw: dict) -> Any:
    # the modulation chunks read as (scale, shift) instead of (shift, scale)
    x, shift, scale = args
    return call(x, scale, shift, **kw)


def _gelu_exact(ov: Overlay, where: str, call: Callable[..., Any], args: tuple, kw: dict) -> Any:
    # the MLP's GELU in its exact (erf) form instead of the tanh approximation
    z = call(*args, **{**kw, "epilogue": "none"})
    return F.gelu(z.float(), approximate="none").to(z.dtype)


def _sigma_shift(ov: Overlay, where: str, call: Callable[..., Any], args: tuple, kw: dict) -> Any:
    # another time shift on the sigma table: s' = k·s / (1 + (k − 1)·s), k = 1.05
    table = call(*args, **kw)
    k = 1.05
    return ((k * table.double()) / (1 + (k - 1) * table.double())).to(table.dtype)


def _cfg_no_renorm(ov: Overlay, where: str, call: Callable[..., Any], args: tuple, kw: dict) -> Any:
    # CFG without the per-token norm rescale
    cond, neg, scale = args
    s32 = torch.tensor(float(scale), dtype=torch.float32, device=cond.device)
    return neg + s32 * (cond - neg)


def _bf16_step(ov: Overlay, where: str, call: Callable[..., Any], args: tuple, kw: dict) -> Any:
    # the SDE step's inputs held in BF16 (an engine that steps in the model dtype)
    v, x, *rest = args

    def r(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).to(torch.float32)

    kw = {k: (r(t) if k in ("noise", "prev_sample") and t is not None else t) for k, t in kw.items()}
    return call(r(v), r(x), *rest, **kw)


def _noise_step_from_one(ov: Overlay, where: str, call: Callable[..., Any], args: tuple, kw: dict) -> Any:
    # SDE noise keyed by a 1-based step counter
    seed, ids, step, *rest = args
    return call(seed, ids, step + 1, *rest, **kw)


def _noise_rank_local(ov: Overlay, where: str, call: Callable[..., Any], args: tuple, kw: dict) -> Any:
    # SDE noise keyed by the sample's index on its rank (samples dealt round-robin to 2 ranks) instead of its global id
    seed, ids, *rest = args
    return call(seed, [i // 2 for i in ids], *rest, **kw)


def _register_all() -> None:
    model_probes: list[tuple[str, str, str, str, str, Callable[..., Any], str | None, bool]] = [
        ("latent_layout", "latent layout", "packed channels ordered (patch, channel) instead of (channel, patch)",
         "img_in.latent_proj_gemm", "latent_proj_gemm", _latent_layout, "img_in", False),
        ("integer_timestep", "timestep encoding", "timesteps rounded to integers of 1000·sigma",
         "embed.timestep_embed_mlp", "timestep_embed_mlp", _integer_timestep, None, False),
        ("stream_weights", "stream weights", "block 0's image MLP up-projection uses the text stream's weights",
         "block0.img.mlp_up_gemm_gelu", "mlp_up_gemm_gelu", _stream_weights, "block0.img", False),
        ("image_first", "sequence order", "joint attention over [image, text] instead of [text, image]",
         "block0.joint.joint_attention_fused", "joint_attention_fused", _image_first, "block0.joint", True),
        ("text_rope_offset", "RoPE", "text RoPE positions start one later",
         "block0.txt.q.multi_axis_rope", "multi_axis_rope", _text_rope_offset, None, False),
        ("qk_norm_eps", "Q/K preprocessing", "Q/K RMSNorm eps 1e-5 instead of 1e-6",
         "block0.img.q.qk_rmsnorm", "qk_rmsnorm", _qk_eps, None, False),
        ("modulation_order", "modulation", "block 0's image modulation reads (scale, shift) as (shift, scale)",
         "block0.img.adaln_modulation", "adaln_modulation", _shift_scale_swapped, "block0.img", False),
        ("gelu_exact", "GELU", "exact (erf) GELU instead of the tanh approximation",
         "block0.img.mlp_up_gemm_gelu", "mlp_up_gemm_gelu", _gelu_exact, None, False),
        ("sigma_shift", "sigma schedule", "sigma table with an extra time shift of 1.05",
         "sampling.flow_sigma_table", "flow_sigma_table", _sigma_shift, None, False),
        ("cfg_no_renorm", "CFG", "CFG combine without the per-token norm rescale",
         "sampling.cfg_combine_renorm", "cfg_combine_renorm", _cfg_no_renorm, None, False),
        ("bf16_sde_step", "step precision", "the SDE step's inputs rounded to BF16",
         "sampling.flow_sde_step_logp", "flow_sde_step_logp", _bf16_step, None, False),
        ("noise_step_key", "noise", "SDE noise keyed by a 1-based step counter",
         "sampling.step_noise", "step_noise", _noise_step_from_one, None, False),
        ("noise_rank_local", "distributed metadata", "SDE noise keyed by the sample's index on its rank (2 ranks, round-robin)",
         "sampling.step_noise", "step_noise", _noise_rank_local, None, False),
    ]
    for name, factor, desc, caught, op, hook, where, strict_only in model_probes:
        register_perturbation(Perturbation(name=name, factor=factor, description=desc, caught_at=caught,
                                           hooks={op: hook}, where=where, strict_only=strict_only))


_register_all()

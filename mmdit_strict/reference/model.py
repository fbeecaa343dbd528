"""Whole-model FP64 reference forward of the Qwen-Image MMDiT (docs/design.md §2), from a diffusers state dict.

Built only from :mod:`mmdit_strict.reference.ops` and :mod:`mmdit_strict.reference.rope`; it shares no code
with the kernels or the model it checks. Samples run one at a time, each with only its valid
(prefix-masked) text tokens, so every sample attends over exactly its own ``[text, image]`` tokens — for
the image stream this is diffusers' masked-attention result — and a sample's FP64 bytes do not depend on
the batch it came in or its prompt padding. Captures are packed valid rows, sample-major.

One block, per stream ``s ∈ {img, txt}`` (``mod_s = SiLU(temb) W_modᵀ + b_mod``, six chunks in the order
shift1, scale1, gate1, shift2, scale2, gate2)::

    h_s   = LayerNorm(x_s)·(1 + scale1) + shift1
    q,k,v = h_s W_{q,k,v}ᵀ + b                  # per head: RMSNorm·gain, then RoPE on q, k
    a_s   = joint attention over [txt, img], then the stream's output projection
    x_s   = x_s + gate1·a_s
    x_s   = x_s + gate2·MLP_s(LayerNorm(x_s)·(1 + scale2) + shift2)   # MLP = Linear, GELU-tanh, Linear
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from mmdit_strict.config.arch import ArchConfig
from mmdit_strict.reference import ops
from mmdit_strict.reference.rope import ImageShape, image_token_count, rope_tables

F64 = torch.float64


def _prefix_lengths(mask: torch.Tensor | None, batch: int, length: int) -> list[int]:
    """Valid text length of each sample; the mask must be a prefix mask ``1…1 0…0`` per row."""
    if mask is None:
        return [length] * batch
    if tuple(mask.shape) != (batch, length):
        raise ValueError(f"expected encoder_hidden_states_mask of shape ({batch}, {length}), got {tuple(mask.shape)}")
    m = mask.detach().to("cpu")  # the mask is data, never differentiated
    valid = m.to(torch.bool)
    if not torch.equal(valid.to(F64), m.to(F64)):
        raise ValueError("encoder_hidden_states_mask must hold only 0/1 (or booleans)")
    lens = valid.sum(dim=1).tolist()
    for b, n in enumerate(lens):
        expected = torch.arange(length) < n
        if not torch.equal(valid[b], expected):
            raise ValueError(
                f"encoder_hidden_states_mask row {b} is not a prefix mask (1…1 0…0); "
                "the reference supports only right-padded prompts"
            )
    return [int(n) for n in lens]


class _Weights:
    """FP64 view of a diffusers-format state dict, with a clear error for a missing parameter."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        self._sd = state_dict
        self._cache: dict[str, torch.Tensor] = {}  # one FP64 copy per parameter for the whole forward

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            try:
                t = self._sd[name]
            except KeyError:
                raise KeyError(
                    f"state dict has no parameter {name!r} (diffusers QwenImageTransformer2DModel naming)"
                ) from None
            self._cache[name] = t.to("cpu", F64)
        return self._cache[name]


def _block(
    w: _Weights,
    prefix: str,
    arch: ArchConfig,
    img: torch.Tensor,
    txt: torch.Tensor,
    temb: torch.Tensor,
    img_lens: Sequence[int],
    txt_lens: Sequence[int],
    img_cos: torch.Tensor,
    img_sin: torch.Tensor,
    txt_cos: torch.Tensor,
    txt_sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One double-stream block on packed rows: img ``(Mi, D)``, txt ``(Mt, D)``, temb ``(B, D)``."""
    d, heads, hd, eps = arch.hidden_size, arch.num_attention_heads, arch.attention_head_dim, arch.eps

    def mod(stream: str) -> list[torch.Tensor]:
        p = ops.linear(temb, w(f"{prefix}.{stream}_mod.1.weight"), w(f"{prefix}.{stream}_mod.1.bias"), prologue="silu")
        return [p[:, j * d:(j + 1) * d] for j in range(6)]  # shift1, scale1, gate1, shift2, scale2, gate2 (B, D)

    i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = mod("img")
    t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = mod("txt")

    # ---- attention
    img_h = ops.adaln_modulation(img, i_shift1, i_scale1, img_lens, eps)  # (Mi, D)
    txt_h = ops.adaln_modulation(txt, t_shift1, t_scale1, txt_lens, eps)  # (Mt, D)

    def proj(x: torch.Tensor, name: str) -> torch.Tensor:  # (M, D) → (M, H, hd)
        y = ops.linear(x, w(f"{prefix}.attn.{name}.weight"), w(f"{prefix}.attn.{name}.bias"))
        return y.reshape(x.shape[0], heads, hd)

    q_img = ops.qk_rmsnorm(proj(img_h, "to_q"), w(f"{prefix}.attn.norm_q.weight"), eps)
    k_img = ops.qk_rmsnorm(proj(img_h, "to_k"), w(f"{prefix}.attn.norm_k.weight"), eps)
    v_img = proj(img_h, "to_v")
    q_txt = ops.qk_rmsnorm(proj(txt_h, "add_q_proj"), w(f"{prefix}.attn.norm_added_q.weight"), eps)
    k_txt = ops.qk_rmsnorm(proj(txt_h, "add_k_proj"), w(f"{prefix}.attn.norm_added_k.weight"), eps)
    v_txt = proj(txt_h, "add_v_proj")

    q_img, k_img = ops.multi_axis_rope(q_img, img_cos, img_sin), ops.multi_axis_rope(k_img, img_cos, img_sin)
    q_txt, k_txt = ops.multi_axis_rope(q_txt, txt_cos, txt_sin), ops.multi_axis_rope(k_txt, txt_cos, txt_sin)

    a_txt, a_img = ops.joint_attention(q_txt, k_txt, v_txt, q_img, k_img, v_img, txt_lens, img_lens)
    a_img = ops.linear(a_img, w(f"{prefix}.attn.to_out.0.weight"), w(f"{prefix}.attn.to_out.0.bias"))
    a_txt = ops.linear(a_txt, w(f"{prefix}.attn.to_add_out.weight"), w(f"{prefix}.attn.to_add_out.bias"))
    img = ops.adaln_gate_residual(img, a_img, i_gate1, img_lens)
    txt = ops.adaln_gate_residual(txt, a_txt, t_gate1, txt_lens)

    # ---- MLP
    def mlp(x: torch.Tensor, stream: str) -> torch.Tensor:
        up = ops.linear(x, w(f"{prefix}.{stream}_mlp.net.0.proj.weight"), w(f"{prefix}.{stream}_mlp.net.0.proj.bias"),
                        epilogue="gelu_tanh")
        return ops.linear(up, w(f"{prefix}.{stream}_mlp.net.2.weight"), w(f"{prefix}.{stream}_mlp.net.2.bias"))

    img = ops.adaln_gate_residual(img, mlp(ops.adaln_modulation(img, i_shift2, i_scale2, img_lens, eps), "img"),
                                  i_gate2, img_lens)
    txt = ops.adaln_gate_residual(txt, mlp(ops.adaln_modulation(txt, t_shift2, t_scale2, txt_lens, eps), "txt"),
                                  t_gate2, txt_lens)
    return img, txt


def reference_forward(
    state_dict: Mapping[str, torch.Tensor],
    arch: ArchConfig,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_mask: torch.Tensor | None,
    timestep: torch.Tensor,
    img_shapes: Sequence[ImageShape | Sequence[ImageShape]],
    *,
    capture: dict | None = None,
) -> torch.Tensor:
    """The Qwen-Image transformer in FP64: velocity for every image token.

    Args:
        state_dict: diffusers-format parameters (any dtype/device; read as CPU FP64).
        arch: architecture (sizes, eps, RoPE axes and theta, timestep channels and scale).
        hidden_states: ``(B, T_img, in_channels)`` packed latents.
        encoder_hidden_states: ``(B, L, joint_attention_dim)`` prompt embeddings.
        encoder_hidden_states_mask: ``(B, L)`` prefix mask (1 = valid) or None (all valid).
        timestep: ``(B,)`` sigma in [0, 1] (the model multiplies by ``arch.timestep_scale``).
        img_shapes: per sample ``(frame, h, w)`` in tokens, or diffusers' list-of-lists form.
        capture: if a dict, receives packed valid rows (FP64) per stage: ``img_in``, ``txt_in``, ``temb``,
            ``block{i}.img`` ``(sum T_img, D)``, ``block{i}.txt`` ``(sum L_valid, D)``, ``norm_out``.

    Returns:
        ``(B, T_img, patch_size² · out_channels)`` FP64.
    """
    if hidden_states.dim() != 3 or hidden_states.shape[2] != arch.in_channels:
        raise ValueError(
            f"expected hidden_states of shape (B, T_img, {arch.in_channels}), got {tuple(hidden_states.shape)}"
        )
    bsz, t_img, _ = hidden_states.shape
    if encoder_hidden_states.dim() != 3 or encoder_hidden_states.shape[0] != bsz \
            or encoder_hidden_states.shape[2] != arch.joint_attention_dim:
        raise ValueError(
            f"expected encoder_hidden_states of shape ({bsz}, L, {arch.joint_attention_dim}), "
            f"got {tuple(encoder_hidden_states.shape)}"
        )
    if timestep.dim() != 1 or timestep.shape[0] != bsz:
        raise ValueError(f"expected timestep of shape ({bsz},), got {tuple(timestep.shape)}")
    if len(img_shapes) != bsz:
        raise ValueError(f"expected {bsz} img_shapes entries (one per sample), got {len(img_shapes)}")
    for b, shape in enumerate(img_shapes):
        if image_token_count(shape) != t_img:
            raise ValueError(
                f"img_shapes[{b}] = {shape!r} gives {image_token_count(shape)} tokens, hidden_states has {t_img}"
            )
    txt_lens = _prefix_lengths(encoder_hidden_states_mask, bsz, encoder_hidden_states.shape[1])

    w = _Weights(state_dict)
    stages: list[dict[str, torch.Tensor]] = []
    outs = []
    for b in range(bsz):  # one sample at a time: its result cannot depend on the rest of the batch
        stage: dict[str, torch.Tensor] = {}
        outs.append(_sample_forward(w, arch, hidden_states[b], encoder_hidden_states[b, :txt_lens[b]],
                                    timestep[b:b + 1], img_shapes[b], stage))
        stages.append(stage)
    if capture is not None:
        for key in stages[0]:
            capture[key] = torch.cat([stage[key] for stage in stages])  # packed rows, sample-major
    return torch.stack(outs)


def _sample_forward(
    w: _Weights,
    arch: ArchConfig,
    img: torch.Tensor,
    txt: torch.Tensor,
    sigma: torch.Tensor,
    img_shape: ImageShape | Sequence[ImageShape],
    stage: dict[str, torch.Tensor],
) -> torch.Tensor:
    """One sample: img ``(T_img, in_channels)``, its valid text ``(L, Ct)``, sigma ``(1,)`` → ``(T_img, out)``."""
    eps = arch.eps
    img_lens, txt_lens = (img.shape[0],), (txt.shape[0],)

    # ---- embeddings
    img = ops.linear(img, w("img_in.weight"), w("img_in.bias"))  # (T_img, D)
    txt = ops.txt_in_rmsnorm_linear(txt, w("txt_norm.weight"), w("txt_in.weight"), w("txt_in.bias"), eps=eps)  # (L, D)
    temb = ops.timestep_embed_mlp(
        sigma,
        w("time_text_embed.timestep_embedder.linear_1.weight"), w("time_text_embed.timestep_embedder.linear_1.bias"),
        w("time_text_embed.timestep_embedder.linear_2.weight"), w("time_text_embed.timestep_embedder.linear_2.bias"),
        channels=arch.timestep_channels, scale=arch.timestep_scale,
    )  # (1, D)
    stage["img_in"], stage["txt_in"], stage["temb"] = img, txt, temb

    (img_cos, img_sin, txt_cos, txt_sin), = rope_tables([img_shape], txt_lens, arch.axes_dims_rope, arch.rope_theta)

    for i in range(arch.num_layers):
        img, txt = _block(w, f"transformer_blocks.{i}", arch, img, txt, temb, img_lens, txt_lens,
                          img_cos, img_sin, txt_cos, txt_sin)
        stage[f"block{i}.img"], stage[f"block{i}.txt"] = img, txt

    img = ops.final_adaln_out(img, temb, w("norm_out.linear.weight"), w("norm_out.linear.bias"), img_lens, eps)
    stage["norm_out"] = img
    return ops.linear(img, w("proj_out.weight"), w("proj_out.bias"))  # (T_img, p²·out_channels)


__all__ = ["reference_forward"]

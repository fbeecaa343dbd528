"""Parameter containers of the Qwen-Image MMDiT with diffusers' module names, and the production forward.

The module tree (and therefore the state-dict keys) is identical to diffusers'
``QwenImageTransformer2DModel``, so checkpoints load without renaming and PEFT target names carry
over. Each module's ``forward`` is the production (runtime ``off``) forward on padded ``(B, T, D)``
tensors: glue around registry operators dispatched to the production backend
(``kernels/production.py``, the one implementation of the production math), so the operator trace
counts the calls that ran and ``capture_operators`` / ``inject_fault`` see them under the strict
graph's keys. The strict runtime reads the same parameters and calls the registry operators on packed
rows instead (see ``strict.py``).

A linear layer that is not a plain ``nn.Linear`` (a PEFT LoRA wrapper, or one carrying hooks) runs
as its own module, so merged / dropped-out / multi-adapter LoRA and offload hooks keep their
semantics; the call is still recorded and captured as its operator.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config.arch import ArchConfig
from ..kernels import production as P
from ..kernels.registry import KernelImpl, dispatch_in
from ..kernels.execution import current
from ..kernels.runtime import Runtime
from ..kernels.trace import record
from .strict import observe_operator

Rope = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def timestep_sinusoid(sigma: torch.Tensor, channels: int, scale: float) -> torch.Tensor:
    """(B,) sigma → (B, channels) FP32 ``[cos | sin]`` (the production operator's sinusoid)."""
    return P.timestep_sinusoid(sigma, channels, scale)


def production_op(name: str, where: str, ref: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """Call operator ``name``'s production implementation, recorded in the trace and seen by capture/fault."""
    overlay = current().overlay
    if overlay is not None:  # an ablation probe on this side (mmdit_strict.overlay): it may replace the call
        return observe_operator(name, where, overlay.call(
            name, where, lambda *a, **k: dispatch_in(Runtime.OFF, name, ref.device, ref.dtype, *a, **k), args, kwargs))
    return observe_operator(name, where, dispatch_in(Runtime.OFF, name, ref.device, ref.dtype, *args, **kwargs))


def is_plain_linear(module: nn.Module) -> bool:
    """A bare ``nn.Linear`` (no PEFT wrapper, no hooks, no patched forward): its weights can go to the operator."""
    return (
        type(module) is nn.Linear and not module._forward_hooks and not module._forward_pre_hooks
        and "forward" not in module.__dict__
    )


@functools.cache
def _module_impl(op: str, cls: type, device: str) -> KernelImpl:
    return KernelImpl(op=op, backend="torch", device=device, dtypes=P.DTYPES, fn=cls.forward, strict=False,
                      kernel_name=f"module_{cls.__name__}", reduction_order="library-chosen (not batch-invariant)",
                      accumulator="library")


def module_op(name: str, where: str, ref: torch.Tensor, modules: tuple[nn.Module, ...], fn: Callable[[], Any]) -> Any:
    """Run ``fn`` (glue around non-plain linear ``modules``) as operator ``name``: traced, captured, faultable."""
    cls = next((type(m) for m in modules if not is_plain_linear(m)), nn.Linear)
    record(name, _module_impl(name, cls, ref.device.type), Runtime.OFF, ref.device.type, ref.dtype, False)
    return observe_operator(name, where, fn())


def linear_op(name: str, where: str, module: nn.Module, x: torch.Tensor, prologue: str = "none", epilogue: str = "none") -> torch.Tensor:
    """A GEMM operator on ``module``'s weights (any leading shape of ``x``)."""
    if is_plain_linear(module):
        return production_op(name, where, x, x, module.weight, module.bias, seqlens=None, prologue=prologue, epilogue=epilogue)
    return module_op(name, where, x, (module,), lambda: P.apply_epilogue(module(P.apply_prologue(x, prologue)), epilogue))


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learned gain (diffusers ``RMSNorm(dim, eps)``); math: ``production.rms_norm``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return P.rms_norm(x, self.weight, self.eps)


class TimestepEmbedding(nn.Module):
    """``linear_1`` (256→D) → SiLU → ``linear_2`` (D→D)."""

    def __init__(self, in_channels: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeTextEmbed(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.channels = cfg.timestep_channels
        self.scale = cfg.timestep_scale
        self.timestep_embedder = TimestepEmbedding(cfg.timestep_channels, cfg.hidden_size)

    def forward(self, sigma: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B,) sigma → (B, D) in ``dtype`` (operator ``timestep_embed_mlp``)."""
        e = self.timestep_embedder
        ref = torch.empty(0, dtype=dtype, device=sigma.device)
        if is_plain_linear(e.linear_1) and is_plain_linear(e.linear_2) and e.linear_1.weight.dtype == dtype:
            return production_op("timestep_embed_mlp", "embed", ref, sigma, e.linear_1.weight, e.linear_1.bias,
                                 e.linear_2.weight, e.linear_2.bias, channels=self.channels, scale=self.scale)
        return module_op("timestep_embed_mlp", "embed", ref, (e.linear_1, e.linear_2),
                         lambda: e(P.timestep_sinusoid(sigma, self.channels, self.scale).to(dtype)))


class GELUProj(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: torch.Tensor, where: str = "mlp") -> torch.Tensor:
        return linear_op("mlp_up_gemm_gelu", where, self.proj, x, epilogue="gelu_tanh")


class FeedForward(nn.Module):
    """``net.0.proj`` (D→4D, tanh-GELU) → ``net.2`` (4D→D)."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([GELUProj(dim, inner), nn.Dropout(0.0), nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor, where: str = "mlp") -> torch.Tensor:
        h = self.net[1](self.net[0](x, where))
        return linear_op("mlp_down_gemm", where, self.net[2], h)


class JointAttention(nn.Module):
    """Joint [text, image] attention with separate per-stream projections and per-head QK RMSNorm."""

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.attention_head_dim
        self.eps = cfg.eps
        self.to_q, self.to_k, self.to_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.add_q_proj, self.add_k_proj, self.add_v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.norm_q = RMSNorm(cfg.attention_head_dim, cfg.eps)
        self.norm_k = RMSNorm(cfg.attention_head_dim, cfg.eps)
        self.norm_added_q = RMSNorm(cfg.attention_head_dim, cfg.eps)
        self.norm_added_k = RMSNorm(cfg.attention_head_dim, cfg.eps)
        self.to_out = nn.ModuleList([nn.Linear(d, d), nn.Dropout(0.0)])
        self.to_add_out = nn.Linear(d, d)

    def _qkv(self, where: str, h: torch.Tensor, proj: nn.Module, norm: RMSNorm | None,
             cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = linear_op("qkv_bias_gemm", where, proj, h).unflatten(-1, (self.heads, self.head_dim))
        if norm is None:
            return t
        t = production_op("qk_rmsnorm", where, t, t, norm.weight, seqlens=None, eps=self.eps)
        return production_op("multi_axis_rope", where, t, t, cos, sin)

    def attend(
        self, img: torch.Tensor, txt: torch.Tensor, txt_lens: list[int] | None, rope: Rope, where: str = "block0",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Modulated ``img (B, Ti, D)``, ``txt (B, Tt, D)`` → attention outputs ``(img, txt)`` before the
        output projections. ``txt_lens``: valid text tokens per sample (``None``: no text padding)."""
        img_cos, img_sin, txt_cos, txt_sin = rope
        wi, wt = f"{where}.img", f"{where}.txt"
        qi = self._qkv(wi + ".q", img, self.to_q, self.norm_q, img_cos, img_sin)
        ki = self._qkv(wi + ".k", img, self.to_k, self.norm_k, img_cos, img_sin)
        vi = self._qkv(wi + ".v", img, self.to_v, None, img_cos, img_sin)
        qt = self._qkv(wt + ".q", txt, self.add_q_proj, self.norm_added_q, txt_cos, txt_sin)
        kt = self._qkv(wt + ".k", txt, self.add_k_proj, self.norm_added_k, txt_cos, txt_sin)
        vt = self._qkv(wt + ".v", txt, self.add_v_proj, None, txt_cos, txt_sin)
        ot, oi = production_op("joint_attention_fused", f"{where}.joint", qi, qt, kt, vt, qi, ki, vi,
                               txt_seqlens=txt_lens, img_seqlens=None)
        return oi, ot

    def forward(
        self, img: torch.Tensor, txt: torch.Tensor, txt_lens: list[int] | None, rope: Rope, where: str = "block0",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`attend` followed by both output projections → ``(img, txt)``."""
        oi, ot = self.attend(img, txt, txt_lens, rope, where)
        return (linear_op("attn_out_bias_gemm", f"{where}.img", self.to_out[0], oi),
                linear_op("attn_out_bias_gemm", f"{where}.txt", self.to_add_out, ot))


class DoubleStreamBlock(nn.Module):
    """One MMDiT block: per-stream AdaLN modulation, joint attention, gated residuals, per-stream MLP."""

    def __init__(self, cfg: ArchConfig, index: int = 0) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.eps = cfg.eps
        self.where = f"block{index}"  # operator keys for the trace, capture and fault injection
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.attn = JointAttention(cfg)
        self.img_mlp = FeedForward(d, cfg.mlp_hidden)
        self.txt_mlp = FeedForward(d, cfg.mlp_hidden)

    def forward(
        self,
        img: torch.Tensor,  # (B, Ti, D)
        txt: torch.Tensor,  # (B, Tt, D)
        txt_lens: list[int] | None,  # valid text tokens per sample, None when no text is padding
        temb: torch.Tensor,  # (B, D)
        rope: Rope,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        wi, wt = f"{self.where}.img", f"{self.where}.txt"
        # (shift, scale, gate) × (attention, MLP), each (B, D)
        imod = linear_op("adaln_mod_projection", wi, self.img_mod[1], temb, prologue="silu").chunk(6, dim=-1)
        tmod = linear_op("adaln_mod_projection", wt, self.txt_mod[1], temb, prologue="silu").chunk(6, dim=-1)
        hi = production_op("adaln_modulation", wi, img, img, imod[0], imod[1], seqlens=None, eps=self.eps)
        ht = production_op("adaln_modulation", wt, txt, txt, tmod[0], tmod[1], seqlens=None, eps=self.eps)
        a = self.attn
        oi, ot = a.attend(hi, ht, txt_lens, rope, self.where)
        img = production_op("adaln_gate_residual", wi + ".attn", img, img,
                            linear_op("attn_out_bias_gemm", wi, a.to_out[0], oi), imod[2], seqlens=None)
        txt = production_op("adaln_gate_residual", wt + ".attn", txt, txt,
                            linear_op("attn_out_bias_gemm", wt, a.to_add_out, ot), tmod[2], seqlens=None)

        def mlp(where: str, x: torch.Tensor, mods: tuple[torch.Tensor, ...], ff: FeedForward) -> torch.Tensor:
            h = production_op("adaln_modulation", where + ".mlp", x, x, mods[3], mods[4], seqlens=None, eps=self.eps)
            return production_op("adaln_gate_residual", where + ".mlp", x, x, ff(h, where), mods[5], seqlens=None)

        return mlp(wi, img, imod, self.img_mlp), mlp(wt, txt, tmod, self.txt_mlp)


class AdaNormOut(nn.Module):
    """Final image-stream modulation: ``scale, shift = Linear(SiLU(temb))``; LayerNorm·(1+scale)+shift."""

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.eps = cfg.eps
        self.linear = nn.Linear(cfg.hidden_size, 2 * cfg.hidden_size)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """``x (B, Ti, D)``, ``temb (B, D)`` → ``(B, Ti, D)`` (operator ``final_adaln_out``)."""
        if is_plain_linear(self.linear):
            return production_op("final_adaln_out", "norm_out", x, x, temb, self.linear.weight, self.linear.bias,
                                 seqlens=None, eps=self.eps)

        def run() -> torch.Tensor:
            scale, shift = self.linear(F.silu(temb)).chunk(2, dim=-1)
            return P.adaln_modulation(x, shift, scale, seqlens=None, eps=self.eps)

        return module_op("final_adaln_out", "norm_out", x, (self.linear,), run)

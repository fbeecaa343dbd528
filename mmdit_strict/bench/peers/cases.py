"""The operator families of the peer survey: what each operator computes, its inputs, its FP64 reference
and the tolerance that judges it.

A :class:`Case` is one of our operators as the survey drives it, whatever implementation runs it. A sample
is a tuple of tensors, each either *rows* of one stream (``(n, ...)``: tokens of the image or text stream,
or one row per sample for a per-sample operator) or a *per-sample vector* (``(1, ...)``: shift, scale,
gate). Every implementation of a case is called as ``fn(*packed, *shared, seqlens=...)`` on the samples
concatenated stream by stream, and returns a tuple of row tensors (one per output), so the harness can cut
a batch's results back per sample and compare their bytes with the same sample run alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ...tolerances import Tolerance, tolerance

EPS = 1e-6
FAMILIES: tuple[str, ...] = ("projection", "norms", "qk_norm_rope", "attention")


@dataclass(frozen=True)
class Widths:
    """The widths of the model the cases are drawn at: Qwen-Image's by default, tiny ones for the CPU."""

    d: int = 3072
    heads: int = 24
    head_dim: int = 128
    mlp: int = 12288


QWEN_IMAGE = Widths()
TINY = Widths(d=32, heads=2, head_dim=8, mlp=64)


@dataclass(frozen=True)
class Case:
    """One operator of a family.

    Attributes:
        family: one of :data:`FAMILIES`.
        op: our operator's name (``kernels/registry.py`` ``OPERATORS``, or a fused pair ``a+b``).
        streams: per sample tensor, the stream whose rows it holds (0, 1), or ``None`` for a per-sample vector.
        out_streams: per output, its stream.
        sample: ``(sizes, generator, dtype) -> tuple``: one sample's tensors for ``sizes`` rows per stream.
        shared: ``(generator, dtype) -> tuple``: the tensors every sample shares (weights, gains).
        grad_samples / grad_shared: which of them get gradients.
        ref: the FP64 reference, same call convention as an implementation.
        tol: ``(tensor name, dtype name, FP64 expected) -> Tolerance`` from ``tolerances.yaml``.
        names: the names of the sample then shared tensors (gradients are reported as ``d<name>``).
        fixed_rows: rows per sample when the operator has one row per sample (the modulation projection).
    """

    family: str
    op: str
    streams: tuple[int | None, ...]
    out_streams: tuple[int, ...]
    sample: Callable[..., tuple]
    shared: Callable[..., tuple]
    grad_samples: tuple[bool, ...]
    grad_shared: tuple[bool, ...]
    ref: Callable[..., tuple]
    tol: Callable[[str, str, torch.Tensor], Tolerance]
    names: tuple[str, ...]
    fixed_rows: int | None = None
    config: dict | None = None  # the static arguments our implementation is called with (prologue, epilogue, eps)


def randn(shape: Sequence[int], gen: torch.Generator, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``scale·N(0, 1)`` drawn in FP32 on the generator's device, then cast to ``dtype``."""
    return (scale * torch.randn(tuple(shape), generator=gen, device=gen.device, dtype=torch.float32)).to(dtype)


def _projection(w: Widths, op: str, n: int, prologue: str, epilogue: str, per_sample: bool) -> Case:
    from ...reference import ops as ref

    k = w.d

    def sample(sizes, g, dt):
        return (randn((sizes[0], k), g, dt),)

    def shared(g, dt):
        return (randn((n, k), g, dt, k ** -0.5), randn((n,), g, dt, 0.1))

    def reference(x, weight, bias, *, seqlens):
        return (ref.linear(x, weight, bias, prologue, epilogue),)

    checks = {"out": "forward", "dx": "dX", "dweight": "dW", "dbias": "db"}
    return Case("projection", op, (0,), (0,), sample, shared, (True,), (True, True), reference,
                lambda name, dname, e: tolerance("gemm", checks[name], dname).resolved(e), ("x", "weight", "bias"),
                fixed_rows=1 if per_sample else None, config={"prologue": prologue, "epilogue": epilogue})


def _norms(w: Widths) -> list[Case]:
    from ...reference import ops as ref

    d = w.d

    def mod_sample(sizes, g, dt):
        return (randn((sizes[0], d), g, dt), randn((1, d), g, dt, 0.5), randn((1, d), g, dt, 0.5))

    def gate_sample(sizes, g, dt):
        return (randn((sizes[0], d), g, dt), randn((sizes[0], d), g, dt), randn((1, d), g, dt, 0.5))

    def none(g, dt):
        return ()

    def row_tol(check):
        return lambda name, dname, e: tolerance("row_ops", check if name == "out" else f"{check}_grad", dname).resolved(e)

    return [
        Case("norms", "adaln_modulation", (0, None, None), (0,), mod_sample, none, (True, True, True), (),
             lambda x, sh, sc, *, seqlens: (ref.adaln_modulation(x, sh, sc, seqlens[0], EPS),),
             row_tol("adaln_modulation"), ("x", "shift", "scale"), config={"eps": EPS}),
        Case("norms", "adaln_gate_residual", (0, 0, None), (0,), gate_sample, none, (True, True, True), (),
             lambda x, y, gt, *, seqlens: (ref.adaln_gate_residual(x, y, gt, seqlens[0]),),
             row_tol("adaln_gate_residual"), ("x", "y", "gate")),
    ]


def rope_tables(n: int, half: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 cos/sin tables ``(n, half)`` of random angles in [0, 200) (the model's tables are FP32 inputs)."""
    ang = 200.0 * torch.rand((n, half), generator=g, device=g.device, dtype=torch.float64)
    return torch.cos(ang).float(), torch.sin(ang).float()


def _qk_norm_rope(w: Widths) -> Case:
    from ...reference import ops as ref

    def sample(sizes, g, dt):
        c, s = rope_tables(sizes[0], w.head_dim // 2, g)
        return (randn((sizes[0], w.heads, w.head_dim), g, dt), c, s)

    def shared(g, dt):
        return ((1 + randn((w.head_dim,), g, torch.float32, 0.1)).to(dt),)

    def reference(x, c, s, gain, *, seqlens):
        return (ref.multi_axis_rope(ref.qk_rmsnorm(x, gain, EPS), c, s),)

    check = "qk_rmsnorm_rope"
    return Case("qk_norm_rope", "qk_rmsnorm+multi_axis_rope", (0, 0, 0), (0,), sample, shared, (True, False, False), (True,),
                reference, lambda name, dname, e: tolerance("row_ops", check if name == "out" else f"{check}_grad", dname).resolved(e),
                ("x", "cos", "sin", "gain"), config={"eps": EPS})


def _attention(w: Widths) -> Case:
    from ...reference import ops as ref

    def sample(sizes, g, dt):
        nt, ni = sizes
        return tuple(randn((n, w.heads, w.head_dim), g, dt) for n in (nt, nt, nt, ni, ni, ni))

    def none(g, dt):
        return ()

    def reference(qt, kt, vt, qi, ki, vi, *, seqlens):
        return ref.joint_attention(qt, kt, vt, qi, ki, vi, seqlens[0], seqlens[1])

    checks = {"out0": "fwd", "out1": "fwd", "dq_txt": "dq", "dk_txt": "dk", "dv_txt": "dv",
              "dq_img": "dq", "dk_img": "dk", "dv_img": "dv"}
    return Case("attention", "joint_attention_fused", (0, 0, 0, 1, 1, 1), (0, 1), sample, none, (True,) * 6, (), reference,
                lambda name, dname, e: tolerance("attention", checks[name], dname).resolved(e),
                ("q_txt", "k_txt", "v_txt", "q_img", "k_img", "v_img"))


def cases(widths: Widths = QWEN_IMAGE, families: Sequence[str] = FAMILIES) -> list[Case]:
    """Every case of ``families`` at ``widths``; an unknown family is an error naming the known ones."""
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown famil{'y' if len(unknown) == 1 else 'ies'} {unknown}; the families are {list(FAMILIES)}")
    out: list[Case] = []
    for fam in families:
        if fam == "projection":
            out += [_projection(widths, "adaln_mod_projection", 6 * widths.d, "silu", "none", per_sample=True),
                    _projection(widths, "qkv_bias_gemm", 3 * widths.d, "none", "none", per_sample=False),
                    _projection(widths, "mlp_up_gemm_gelu", widths.mlp, "none", "gelu_tanh", per_sample=False)]
        elif fam == "norms":
            out += _norms(widths)
        elif fam == "qk_norm_rope":
            out.append(_qk_norm_rope(widths))
        else:
            out.append(_attention(widths))
    return out

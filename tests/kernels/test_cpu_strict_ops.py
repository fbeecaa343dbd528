"""Every CPU strict operator through the shared harness (tests/harness.py).

Per operator: forward and every gradient against the independent FP64 reference
(``mmdit_strict.reference.ops``) within ``tolerances.yaml: ops.<op>[_grad].fp32``; raw-byte batch
invariance (a singleton vs every row of B ∈ {2, 3, 64, 257}, batch position, reversal), token sweeps
with non-multiples of the 32-row tile, per-sample parameter-gradient folds; fused vs unfused
attention bytes; bad inputs. Tiny widths (24/40) keep the whole file fast.
"""

from __future__ import annotations

import math

import pytest
import torch

from mmdit_strict.kernels.cpu import attention as cpu_attn
from mmdit_strict.kernels.cpu import embed as cpu_embed
from mmdit_strict.kernels.cpu import gemm as cpu_gemm
from mmdit_strict.kernels.cpu import norms as cpu_norms
from mmdit_strict.reference import ops as ref
from mmdit_strict.tolerances import tolerance
from tests.harness import (
    CPU_FP32,
    BadCase,
    assert_bytes_equal,
    check_bad_inputs,
    check_grad_accuracy,
    check_param_grad_fold,
    check_repeat_determinism,
    check_row_invariance,
    check_token_sweep,
    generator,
    packed_op,
    randn,
    rows_op,
    run_with_grads,
)

T = CPU_FP32
K, N, D = 40, 24, 24  # input width, output width, model width
H, HD = 3, 8  # heads × head width for the attention-side operators
EPS = 1e-6
SWEEP = (1, 7, 31, 32, 33, 100)
FOLD_LENS = (7, 1, 33, 100, 32)


def tol(op: str) -> dict:
    return {"fwd": tolerance("ops", op, "fp32"), "grad": tolerance("ops", f"{op}_grad", "fp32")}


def _params(seed: int, *shapes: tuple[int, ...], scale: float = 0.3) -> list[torch.Tensor]:
    g = generator(seed)
    return [randn(*s, gen=g, scale=scale) for s in shapes]


def _grad_fn(fn, wrt):
    """Wrap ``fn(*inputs, seqlens=)`` into ``(inputs..., grad_out, seqlens=) -> (out, grads of wrt)``."""

    def run(*tensors, seqlens):
        *inputs, gout = tensors
        out, grads = run_with_grads(lambda *a: fn(*a, seqlens=seqlens), inputs, gout, wrt)
        return (out,) + tuple(grads[i] for i in wrt)

    return run


def _split(out: torch.Tensor, seqlens) -> list[torch.Tensor]:
    return list(out.split(list(seqlens)))


# ----------------------------------------------------------------------------------------------- GEMM

GEMM_VARIANTS = [
    ("none", "none", False),
    ("silu", "none", False),  # adaln_mod_projection
    ("none", "gelu_tanh", True),  # mlp_up_gemm_gelu with a LoRA
    ("none", "silu", True),
]


def _gemm_params(lora: bool, k: int = K, n: int = N, seed: int = 3):
    w, b, a, bm = _params(seed, (n, k), (n,), (4, k), (n, 4))
    return w, b, (a, bm, 0.5) if lora else None


@pytest.mark.parametrize("prologue,epilogue,lora", GEMM_VARIANTS)
@pytest.mark.parametrize("seqlens", [(45,), (7, 38), (1, 1, 1)])
def test_gemm_accuracy(prologue, epilogue, lora, seqlens):
    w, b, lo = _gemm_params(lora)
    x = randn(sum(seqlens), K, gen=generator(1))
    if lo is None:
        fn = lambda x, w, b: cpu_gemm.gemm(x, w, b, seqlens=seqlens, prologue=prologue, epilogue=epilogue)  # noqa: E731
        rf = lambda x, w, b: ref.linear(x, w, b, prologue, epilogue)  # noqa: E731
        inputs = [x, w, b]
    else:
        fn = lambda x, w, b, a, bm: cpu_gemm.gemm(x, w, b, seqlens=seqlens, prologue=prologue, epilogue=epilogue, lora=(a, bm, 0.5))  # noqa: E731
        rf = lambda x, w, b, a, bm: ref.linear(x, w, b, prologue, epilogue, lora=(a, bm, 0.5))  # noqa: E731
        inputs = [x, w, b, lo[0], lo[1]]
    check_grad_accuracy(fn, rf, inputs, tol("gemm"), target=T, what=f"gemm {prologue}/{epilogue}/lora={lora}")


def test_gemm_no_bias_accuracy():
    w, _, _ = _gemm_params(False)
    x = randn(33, K, gen=generator(2))
    check_grad_accuracy(lambda x, w: cpu_gemm.gemm(x, w, None, seqlens=(33,)), lambda x, w: ref.linear(x, w), [x, w],
                        tol("gemm"), target=T, what="gemm without bias")


@pytest.mark.parametrize("prologue,epilogue,lora", GEMM_VARIANTS)
def test_gemm_row_invariance_fwd_and_dx(prologue, epilogue, lora):
    w, b, lo = _gemm_params(lora)
    fn = _grad_fn(lambda x, seqlens: cpu_gemm.gemm(x, w, b, seqlens=seqlens, prologue=prologue, epilogue=epilogue, lora=lo), [0])
    check_row_invariance(
        rows_op(lambda x, g: fn(x, g, seqlens=(x.shape[0],))),
        lambda gen: (randn(K, gen=gen), randn(N, gen=gen)),
        what=f"gemm {prologue}/{epilogue}/lora={lora} (y, dx)",
    )


@pytest.mark.parametrize("prologue,epilogue,lora", GEMM_VARIANTS[::2])
def test_gemm_token_sweep(prologue, epilogue, lora):
    w, b, lo = _gemm_params(lora)
    fn = _grad_fn(lambda x, seqlens: cpu_gemm.gemm(x, w, b, seqlens=seqlens, prologue=prologue, epilogue=epilogue, lora=lo), [0])
    check_token_sweep(packed_op(fn), lambda n, gen: (randn(n, K, gen=gen), randn(n, N, gen=gen)), SWEEP,
                      row_local=True, what=f"gemm {prologue}/{epilogue}")


@pytest.mark.parametrize("prologue,epilogue,lora", [GEMM_VARIANTS[0], GEMM_VARIANTS[2]])
def test_gemm_param_grad_fold(prologue, epilogue, lora):
    w, b, lo = _gemm_params(lora)
    gen = generator(5)
    items = [randn(n, K, gen=gen) for n in FOLD_LENS]
    gouts = [randn(n, N, gen=gen) for n in FOLD_LENS]

    def fn(batch, params):
        seq = tuple(t.shape[0] for t in batch)
        lora_arg = (params[2], params[3], 0.5) if lo is not None else None
        out = cpu_gemm.gemm(torch.cat(batch), params[0], params[1], seqlens=seq, prologue=prologue, epilogue=epilogue, lora=lora_arg)
        return _split(out, seq)

    params = [w, b] + ([lo[0], lo[1]] if lo is not None else [])
    check_param_grad_fold(fn, items, params, gouts, what=f"gemm {prologue}/{epilogue}/lora={lora} dW/db/dA/dB")


def test_gemm_modulation_rows_fold():
    """adaln_mod_projection shape: one row per sample, seqlens (1,)*B, SiLU prologue."""
    w, b, _ = _gemm_params(False, k=D, n=6 * D)
    gen = generator(6)
    items = [randn(1, D, gen=gen) for _ in range(9)]
    gouts = [randn(1, 6 * D, gen=gen) for _ in range(9)]

    def fn(batch, params):
        out = cpu_gemm.gemm(torch.cat(batch), params[0], params[1], seqlens=(1,) * len(batch), prologue="silu")
        return _split(out, (1,) * len(batch))

    check_param_grad_fold(fn, items, [w, b], gouts, what="adaln_mod_projection dW/db")


def test_gemm_repeat_determinism():
    w, b, lo = _gemm_params(True)
    x, g = randn(77, K, gen=generator(7)), randn(77, N, gen=generator(8))

    def run():
        return run_with_grads(lambda x, w, b, a, bm: cpu_gemm.gemm(x, w, b, seqlens=(30, 47), epilogue="gelu_tanh", lora=(a, bm, 0.5)),
                              [x, w, b, lo[0], lo[1]], g)

    check_repeat_determinism(run, what="gemm fwd+bwd")


def test_gemm_bad_inputs():
    w, b, lo = _gemm_params(True)
    x = randn(5, K, gen=generator(0))
    f = cpu_gemm.gemm
    check_bad_inputs(f, [
        BadCase("wrong K", (randn(5, K + 1, gen=generator(0)), w, b), {"seqlens": (5,)}, f"(N, {K + 1})"),
        BadCase("3-d x", (x[None], w, b), {"seqlens": (5,)}, "(M, K)"),
        BadCase("bias shape", (x, w, b[:-1]), {"seqlens": (5,)}, "bias"),
        BadCase("seqlens sum", (x, w, b), {"seqlens": (2, 2)}, "sum to the 5 rows"),
        BadCase("negative seqlens", (x, w, b), {"seqlens": (6, -1)}, "non-negative"),
        BadCase("unknown prologue", (x, w, b), {"seqlens": (5,), "prologue": "relu"}, "prologue"),
        BadCase("unknown epilogue", (x, w, b), {"seqlens": (5,), "epilogue": "gelu"}, "epilogue"),
        BadCase("LoRA shapes", (x, w, b), {"seqlens": (5,), "lora": (lo[0][:, :-1], lo[1], 0.5)}, "LoRA"),
        BadCase("bf16", (x.bfloat16(), w.bfloat16(), b.bfloat16()), {"seqlens": (5,)}, "float32"),
        BadCase("fp64", (x.double(), w, b), {"seqlens": (5,)}, "float32"),
    ])


# ------------------------------------------------------------------------------------ modulation, norms


def test_adaln_modulation_accuracy():
    seq = (7, 38, 1)
    x = randn(sum(seq), D, gen=generator(1), scale=2.0)
    shift, scale = _params(2, (3, D), (3, D), scale=0.5)
    check_grad_accuracy(
        lambda x, sh, sc: cpu_norms.adaln_modulation(x, sh, sc, seqlens=seq, eps=EPS),
        lambda x, sh, sc: ref.adaln_modulation(x, sh, sc, seq, EPS),
        [x + 0.7, shift, scale], tol("adaln_modulation"), target=T, what="adaln_modulation",
    )


def test_adaln_modulation_invariance():
    fn = _grad_fn(lambda x, sh, sc, seqlens: cpu_norms.adaln_modulation(x, sh, sc, seqlens=seqlens, eps=EPS), [0, 1, 2])
    check_row_invariance(packed_op(fn), lambda gen: tuple(randn(1, D, gen=gen) for _ in range(4)),
                         what="adaln_modulation (y, dx, dshift, dscale)")

    def sample(n, gen):
        sh, sc = randn(1, D, gen=gen), randn(1, D, gen=gen)
        return (randn(n, D, gen=gen), sh, sc, randn(n, D, gen=gen))

    check_token_sweep(packed_op(fn), sample, SWEEP, what="adaln_modulation (y, dx, dshift, dscale)")


def test_adaln_gate_residual_accuracy_and_invariance():
    seq = (33, 7)
    x, y = randn(40, D, gen=generator(1)), randn(40, D, gen=generator(2))
    (gate,) = _params(3, (2, D))
    check_grad_accuracy(
        lambda x, y, g: cpu_norms.adaln_gate_residual(x, y, g, seqlens=seq),
        lambda x, y, g: ref.adaln_gate_residual(x, y, g, seq),
        [x, y, gate], tol("adaln_gate_residual"), target=T, what="adaln_gate_residual",
    )
    fn = _grad_fn(lambda x, y, g, seqlens: cpu_norms.adaln_gate_residual(x, y, g, seqlens=seqlens), [0, 1, 2])
    check_row_invariance(packed_op(fn), lambda gen: (randn(1, D, gen=gen), randn(1, D, gen=gen), randn(1, D, gen=gen), randn(1, D, gen=gen)),
                         what="adaln_gate_residual (out, dx, dy, dgate)")
    check_token_sweep(packed_op(fn), lambda n, gen: (randn(n, D, gen=gen), randn(n, D, gen=gen), randn(1, D, gen=gen), randn(n, D, gen=gen)),
                      SWEEP, what="adaln_gate_residual (out, dx, dy, dgate)")


def test_qk_rmsnorm_accuracy_invariance_fold():
    seq = (31, 2)
    x = randn(33, H, HD, gen=generator(1), scale=1.5)
    (gain,) = _params(2, (HD,), scale=0.1)
    gain = gain + 1.0
    check_grad_accuracy(
        lambda x, g: cpu_norms.qk_rmsnorm(x, g, seqlens=seq, eps=EPS),
        lambda x, g: ref.qk_rmsnorm(x, g, EPS, seqlens=seq),
        [x, gain], tol("qk_rmsnorm"), target=T, what="qk_rmsnorm",
    )
    fn = _grad_fn(lambda x, seqlens: cpu_norms.qk_rmsnorm(x, gain, seqlens=seqlens, eps=EPS), [0])
    check_row_invariance(packed_op(fn), lambda gen: (randn(1, H, HD, gen=gen), randn(1, H, HD, gen=gen)), what="qk_rmsnorm (y, dx)")
    check_token_sweep(packed_op(fn), lambda n, gen: (randn(n, H, HD, gen=gen), randn(n, H, HD, gen=gen)), SWEEP,
                      row_local=True, what="qk_rmsnorm (y, dx)")
    gen = generator(4)
    items = [randn(n, H, HD, gen=gen) for n in FOLD_LENS]
    gouts = [randn(n, H, HD, gen=gen) for n in FOLD_LENS]

    def batch(b, params):
        seq = tuple(t.shape[0] for t in b)
        return _split(cpu_norms.qk_rmsnorm(torch.cat(b), params[0], seqlens=seq, eps=EPS), seq)

    check_param_grad_fold(batch, items, [gain], gouts, what="qk_rmsnorm dgain")


def test_txt_in_rmsnorm_linear_accuracy_invariance_fold():
    Ct = 48
    seq = (12, 33)
    x = randn(45, Ct, gen=generator(1), scale=3.0)
    gain, w, b, a, bm = _params(2, (Ct,), (D, Ct), (D,), (4, Ct), (D, 4))
    gain = gain + 1.0
    check_grad_accuracy(
        lambda x, g, w, b, a, bm: cpu_norms.txt_in_rmsnorm_linear(x, g, w, b, seqlens=seq, eps=EPS, lora=(a, bm, 0.5)),
        lambda x, g, w, b, a, bm: ref.txt_in_rmsnorm_linear(x, g, w, b, eps=EPS, seqlens=seq, lora=(a, bm, 0.5)),
        [x, gain, w, b, a, bm], tol("txt_in_rmsnorm_linear"), target=T, what="txt_in_rmsnorm_linear",
    )
    fn = _grad_fn(lambda x, seqlens: cpu_norms.txt_in_rmsnorm_linear(x, gain, w, b, seqlens=seqlens, eps=EPS), [0])
    check_row_invariance(packed_op(fn), lambda gen: (randn(1, Ct, gen=gen), randn(1, D, gen=gen)), what="txt_in_rmsnorm_linear (y, dx)")
    check_token_sweep(packed_op(fn), lambda n, gen: (randn(n, Ct, gen=gen), randn(n, D, gen=gen)), SWEEP,
                      row_local=True, what="txt_in_rmsnorm_linear (y, dx)")
    gen = generator(4)
    items = [randn(n, Ct, gen=gen) for n in FOLD_LENS]
    gouts = [randn(n, D, gen=gen) for n in FOLD_LENS]

    def batch(bt, p):
        seq = tuple(t.shape[0] for t in bt)
        return _split(cpu_norms.txt_in_rmsnorm_linear(torch.cat(bt), p[0], p[1], p[2], seqlens=seq, eps=EPS, lora=(p[3], p[4], 0.5)), seq)

    check_param_grad_fold(batch, items, [gain, w, b, a, bm], gouts, what="txt_in_rmsnorm_linear dgain/dW/db/dA/dB")


def test_final_adaln_out_accuracy_invariance_fold():
    seq = (9, 33, 1)
    x = randn(43, D, gen=generator(1), scale=2.0)
    temb = randn(3, D, gen=generator(2))
    w, b = _params(3, (2 * D, D), (2 * D,))
    check_grad_accuracy(
        lambda x, t, w, b: cpu_norms.final_adaln_out(x, t, w, b, seqlens=seq, eps=EPS),
        lambda x, t, w, b: ref.final_adaln_out(x, t, w, b, seq, EPS),
        [x, temb, w, b], tol("final_adaln_out"), target=T, what="final_adaln_out",
    )
    fn = _grad_fn(lambda x, t, seqlens: cpu_norms.final_adaln_out(x, t, w, b, seqlens=seqlens, eps=EPS), [0, 1])
    check_row_invariance(packed_op(fn), lambda gen: (randn(1, D, gen=gen), randn(1, D, gen=gen), randn(1, D, gen=gen)),
                         what="final_adaln_out (y, dx, dtemb)")
    check_token_sweep(packed_op(fn), lambda n, gen: (randn(n, D, gen=gen), randn(1, D, gen=gen), randn(n, D, gen=gen)), SWEEP,
                      what="final_adaln_out (y, dx, dtemb)")
    gen = generator(4)
    items = [(randn(n, D, gen=gen), randn(1, D, gen=gen)) for n in FOLD_LENS]
    gouts = [randn(n, D, gen=gen) for n in FOLD_LENS]

    def batch(bt, p):
        seq = tuple(t[0].shape[0] for t in bt)
        out = cpu_norms.final_adaln_out(torch.cat([t[0] for t in bt]), torch.cat([t[1] for t in bt]), p[0], p[1], seqlens=seq, eps=EPS)
        return _split(out, seq)

    check_param_grad_fold(batch, items, [w, b], gouts, what="final_adaln_out dW/db")


# ------------------------------------------------------------------------------------ timestep, RoPE


def _sigmas(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.rand(n, generator=gen, dtype=torch.float32)


def test_timestep_embed_mlp_accuracy_invariance_fold():
    C = 32
    w1, b1, w2, b2 = _params(1, (D, C), (D,), (D, D), (D,))
    sig = torch.tensor([1.0, 0.5, 0.02, 0.0, 0.731], dtype=torch.float32)
    kw = dict(channels=C, scale=1000.0)
    check_grad_accuracy(
        lambda s, w1, b1, w2, b2: cpu_embed.timestep_embed_mlp(s, w1, b1, w2, b2, **kw),
        lambda s, w1, b1, w2, b2: ref.timestep_embed_mlp(s, w1, b1, w2, b2, **kw),
        [sig, w1, b1, w2, b2], tol("timestep_embed_mlp"), target=T, wrt=[1, 2, 3, 4], what="timestep_embed_mlp",
    )
    check_row_invariance(rows_op(lambda s: cpu_embed.timestep_embed_mlp(s, w1, b1, w2, b2, **kw)),
                         lambda gen: _sigmas(gen, 1)[0], what="timestep_embed_mlp")
    gen = generator(4)
    items = [_sigmas(gen, 1) for _ in range(6)]
    gouts = [randn(1, D, gen=gen) for _ in range(6)]

    def batch(bt, p):
        return list(cpu_embed.timestep_embed_mlp(torch.cat(bt), *p, **kw).split(1))

    check_param_grad_fold(batch, items, [w1, b1, w2, b2], gouts, what="timestep_embed_mlp dW1/db1/dW2/db2")


def _rope_tables(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ang = 20.0 * torch.rand(n, HD // 2, generator=gen, dtype=torch.float64) - 10.0
    return torch.cos(ang).float(), torch.sin(ang).float()


def test_multi_axis_rope_accuracy_and_invariance():
    x = randn(45, H, HD, gen=generator(1))
    cos, sin = _rope_tables(45, generator(2))
    check_grad_accuracy(cpu_embed.multi_axis_rope, ref.multi_axis_rope, [x, cos, sin], tol("multi_axis_rope"), target=T,
                        wrt=[0], what="multi_axis_rope")

    def fn(x, c, s, g, seqlens):
        out, grads = run_with_grads(lambda x: cpu_embed.multi_axis_rope(x, c, s), [x], g, [0])
        return out, grads[0]

    def row(gen):
        c, s = _rope_tables(1, gen)
        return (randn(1, H, HD, gen=gen), c, s, randn(1, H, HD, gen=gen))

    def sample(n, gen):
        c, s = _rope_tables(n, gen)
        return (randn(n, H, HD, gen=gen), c, s, randn(n, H, HD, gen=gen))

    check_row_invariance(packed_op(fn), row, what="multi_axis_rope (y, dx)")
    check_token_sweep(packed_op(fn), sample, SWEEP, row_local=True, what="multi_axis_rope (y, dx)")


def test_timestep_and_rope_bad_inputs():
    w1, b1, w2, b2 = _params(1, (D, 32), (D,), (D, D), (D,))
    check_bad_inputs(cpu_embed.timestep_embed_mlp, [
        BadCase("2-d sigma", (torch.zeros(2, 1), w1, b1, w2, b2), {"channels": 32, "scale": 1000.0}, "(B,)"),
        BadCase("fp64 sigma", (torch.zeros(2, dtype=torch.float64), w1, b1, w2, b2), {"channels": 32, "scale": 1000.0}, "float32"),
    ])
    x = randn(5, H, HD, gen=generator(0))
    cos, sin = _rope_tables(5, generator(1))
    check_bad_inputs(cpu_embed.multi_axis_rope, [
        BadCase("table rows", (x, cos[:4], sin[:4]), {}, "tables"),
        BadCase("table width", (x, cos[:, :-1], sin[:, :-1]), {}, "tables"),
        BadCase("2-d x", (x.reshape(5, -1), cos, sin), {}, "(M, H, d)"),
        BadCase("bf16", (x.bfloat16(), cos, sin), {}, "float32"),
    ])


def test_norm_bad_inputs():
    x = randn(5, D, gen=generator(0))
    v = randn(2, D, gen=generator(1))
    check_bad_inputs(cpu_norms.adaln_modulation, [
        BadCase("shift rows", (x, v[:1], v), {"seqlens": (2, 3), "eps": EPS}, "(2, 24)"),
        BadCase("seqlens", (x, v, v), {"seqlens": (2, 2), "eps": EPS}, "sum to the 5 rows"),
        BadCase("bf16", (x.bfloat16(), v, v), {"seqlens": (2, 3), "eps": EPS}, "float32"),
    ])
    check_bad_inputs(cpu_norms.adaln_gate_residual, [
        BadCase("y shape", (x, x[:4], v), {"seqlens": (2, 3)}, "differ"),
        BadCase("gate width", (x, x, v[:, :-1]), {"seqlens": (2, 3)}, "gate"),
    ])
    check_bad_inputs(cpu_norms.qk_rmsnorm, [
        BadCase("gain width", (x.reshape(5, 3, 8), torch.ones(7)), {"seqlens": (5,), "eps": EPS}, "gain (d,)"),
        BadCase("2-d x", (x, torch.ones(24)), {"seqlens": (5,), "eps": EPS}, "(M, H, d)"),
    ])
    check_bad_inputs(cpu_norms.txt_in_rmsnorm_linear, [
        BadCase("gain width", (x, torch.ones(7), torch.ones(4, D), None), {"seqlens": (5,), "eps": EPS}, "gain"),
    ])
    check_bad_inputs(cpu_norms.final_adaln_out, [
        BadCase("temb rows", (x, v[:1], torch.ones(2 * D, D), None), {"seqlens": (2, 3), "eps": EPS}, "temb"),
    ])


# ---------------------------------------------------------------------------------------------- attention

QKV = 6  # q_txt, k_txt, v_txt, q_img, k_img, v_img


def _attn_sample(nt: int, ni: int, gen: torch.Generator, scale: float = 1.0) -> tuple[torch.Tensor, ...]:
    """(q_t, k_t, v_t, g_t, q_i, k_i, v_i, g_i): a sample's own text and image rows plus output grads."""
    t = [randn(nt, H, HD, gen=gen, scale=scale) for _ in range(3)] + [randn(nt, H * HD, gen=gen)]
    i = [randn(ni, H, HD, gen=gen, scale=scale) for _ in range(3)] + [randn(ni, H * HD, gen=gen)]
    return tuple(t + i)


def _attention_batch(items):
    """Batch function: pack the samples, run fused attention forward + backward, split per sample."""
    tseq = tuple(it[0].shape[0] for it in items)
    iseq = tuple(it[4].shape[0] for it in items)
    cat = [torch.cat([it[k] for it in items]) for k in range(8)]
    qt, kt, vt, gt, qi, ki, vi, gi = cat
    (ot, oi), grads = run_with_grads(
        lambda *a: cpu_attn.joint_attention_fused(*a, txt_seqlens=tseq, img_seqlens=iseq),
        [qt, kt, vt, qi, ki, vi], (gt, gi),
    )
    outs = []
    ts = is_ = 0
    for nt, ni in zip(tseq, iseq):
        outs.append((ot[ts:ts + nt], oi[is_:is_ + ni]) + tuple(g[ts:ts + nt] for g in grads[:3]) + tuple(g[is_:is_ + ni] for g in grads[3:]))
        ts, is_ = ts + nt, is_ + ni
    return outs


def test_joint_attention_accuracy():
    tseq, iseq = (5, 12, 1), (16, 9, 33)
    gen = generator(1)
    qkv = [randn(sum(tseq), H, HD, gen=gen, scale=1.5) for _ in range(3)] + [randn(sum(iseq), H, HD, gen=gen, scale=1.5) for _ in range(3)]
    check_grad_accuracy(
        lambda *a: cpu_attn.joint_attention_fused(*a, txt_seqlens=tseq, img_seqlens=iseq),
        lambda *a: ref.joint_attention(*a, tseq, iseq),
        qkv, tol("joint_attention"), target=T, what="joint_attention_fused",
    )


def test_joint_attention_parts_accuracy():
    """The three unfused parts against FP64 (reference linear per head; torch's FP64 softmax)."""
    L = 37
    q, k, v = (randn(H, L, HD, gen=generator(s), scale=1.5) for s in (1, 2, 3))
    per_head = lambda f: lambda a, b: torch.stack([f(a[h], b[h]) for h in range(a.shape[0])])  # noqa: E731
    check_grad_accuracy(cpu_attn.joint_attn_qk_gemm, per_head(lambda a, b: ref.linear(a, b) / math.sqrt(HD)), [q, k],
                        tol("joint_attention"), target=T, what="joint_attn_qk_gemm")
    s = cpu_attn.joint_attn_qk_gemm(q, k)
    check_grad_accuracy(cpu_attn.joint_attn_softmax, lambda s: torch.softmax(s, dim=-1), [s], tol("joint_attention"),
                        target=T, what="joint_attn_softmax")
    p = cpu_attn.joint_attn_softmax(s)
    check_grad_accuracy(cpu_attn.joint_attn_av_gemm, per_head(lambda a, b: ref.linear(a, b.T)), [p, v],
                        tol("joint_attention"), target=T, what="joint_attn_av_gemm")


def _ref_attention_from_parts(q_txt, k_txt, v_txt, q_img, k_img, v_img, *, txt_seqlens, img_seqlens):
    """FP64 joint attention composed from the reference's parts, sample by sample and head by head:
    ``ref.linear(q, k) / √d`` → FP64 softmax → ``ref.linear(p, vᵀ)`` (no code shared with the CPU strict op)."""
    outs_t, outs_i = [], []
    ts = is_ = 0
    for nt, ni in zip(txt_seqlens, img_seqlens):
        rows = [torch.cat([a[ts:ts + nt], b[is_:is_ + ni]]) for a, b in ((q_txt, q_img), (k_txt, k_img), (v_txt, v_img))]
        q, k, v = rows
        o = torch.cat([ref.linear(torch.softmax(ref.linear(q[:, h], k[:, h]) / math.sqrt(q.shape[-1]), dim=-1), v[:, h].T)
                       for h in range(q.shape[1])], dim=-1)
        outs_t.append(o[:nt])
        outs_i.append(o[nt:])
        ts, is_ = ts + nt, is_ + ni
    return torch.cat(outs_t), torch.cat(outs_i)


def test_joint_attention_fused_vs_independent_paths():
    """The fused CPU strict op against two paths that share none of its code, forward and every input
    gradient: the FP64 composition of the reference's unfused parts (within ``ops.joint_attention``), and
    the production path — padded rows, a key mask and PyTorch's SDPA, resolved through the registry for
    ``runtime=off`` — in FP32 (within ``ops.joint_attention_vs_production``). Lengths include an empty
    text segment and non-multiples of every tile."""
    from mmdit_strict.kernels.registry import resolve
    from mmdit_strict.kernels.runtime import Runtime

    tseq, iseq = (5, 12, 0), (16, 33, 9)
    gen = generator(2)
    qkv = [randn(sum(tseq), H, HD, gen=gen, scale=1.5) for _ in range(3)] + [randn(sum(iseq), H, HD, gen=gen, scale=1.5) for _ in range(3)]
    seq = dict(txt_seqlens=tseq, img_seqlens=iseq)
    check_grad_accuracy(cpu_attn.joint_attention_fused, _ref_attention_from_parts, qkv, tol("joint_attention"),
                        target=T, what="joint_attention_fused vs FP64 parts", kwargs=seq)
    prod, fell_back = resolve("joint_attention_fused", "cpu", torch.float32, Runtime.OFF)
    assert prod.backend == "torch" and not prod.strict and not fell_back
    gout = (randn(sum(tseq), H * HD, gen=gen), randn(sum(iseq), H * HD, gen=gen))
    strict_out, strict_grads = run_with_grads(cpu_attn.joint_attention_fused, qkv, gout, **seq)
    prod_out, prod_grads = run_with_grads(prod.fn, qkv, gout, **seq)
    bounds = tol("joint_attention_vs_production")
    for name, a, b in [("out_txt", strict_out[0], prod_out[0]), ("out_img", strict_out[1], prod_out[1])] + [
            (f"grad{i}", g, h) for i, (g, h) in enumerate(zip(strict_grads, prod_grads))]:
        bound = bounds["grad" if name.startswith("grad") else "fwd"]
        ok, max_abs, _ = bound.check(a, b)
        assert ok, f"{name}: CPU strict vs production max abs {max_abs:.3e} (rtol {bound.rtol}, atol {bound.atol})"


def test_joint_attention_batch_invariance():
    check_row_invariance(_attention_batch, lambda gen: _attn_sample(3, 5, gen),
                         what="joint_attention (out, dq, dk, dv)")
    # Token sweep over image lengths and over text lengths (prompt padding in a padded layout).
    check_token_sweep(_attention_batch, lambda n, gen: _attn_sample(4, n, gen), SWEEP, what="joint_attention image-length sweep")
    check_token_sweep(_attention_batch, lambda n, gen: _attn_sample(n, 9, gen), (1, 2, 7, 31, 33), what="joint_attention text-length sweep")


def test_joint_attention_prompt_padding_invariance():
    """A sample's rows do not change when its batch-mates' prompts grow (what padding would be in a padded layout)."""
    gen = generator(3)
    probe = _attn_sample(6, 16, gen)
    (alone,) = _attention_batch([probe])
    for extra in range(0, 40, 7):
        mates = [_attn_sample(6 + extra, 16, generator(10 + extra)), _attn_sample(1 + extra, 16, generator(50 + extra))]
        for pos in range(3):
            batch = mates[:pos] + [probe] + mates[pos:]
            assert_bytes_equal(_attention_batch(batch)[pos], alone, f"joint_attention: mates with +{extra} text tokens, position {pos}")


def test_joint_attention_repeat_determinism():
    items = [_attn_sample(7, 33, generator(s)) for s in range(3)]
    check_repeat_determinism(lambda: _attention_batch(items), what="joint_attention fwd+bwd")


def test_joint_attention_bad_inputs():
    gen = generator(0)
    t = [randn(4, H, HD, gen=gen) for _ in range(3)]
    i = [randn(9, H, HD, gen=gen) for _ in range(3)]
    f = cpu_attn.joint_attention_fused
    check_bad_inputs(f, [
        BadCase("txt seqlens sum", (*t, *i), {"txt_seqlens": (3,), "img_seqlens": (9,)}, "q_txt"),
        BadCase("img seqlens sum", (*t, *i), {"txt_seqlens": (4,), "img_seqlens": (8,)}, "q_img"),
        BadCase("sample counts", (*t, *i), {"txt_seqlens": (2, 2), "img_seqlens": (9,)}, "samples"),
        BadCase("bf16", (*[a.bfloat16() for a in t], *i), {"txt_seqlens": (4,), "img_seqlens": (9,)}, "float32"),
        BadCase("2-d", (*[a.reshape(4, -1) for a in t], *i), {"txt_seqlens": (4,), "img_seqlens": (9,)}, "(M, H, d)"),
    ])


# ------------------------------------------------------------------------------- the harness itself


def test_harness_detects_failures():
    """The checks above are only worth something if they fail on the defects they look for."""
    a = randn(4, 5, gen=generator(0))
    b = a.clone()
    b[2, 3] = torch.nextafter(b[2, 3], torch.tensor(float("inf")))
    with pytest.raises(AssertionError, match=r"1/20 elements; first at index \(2, 3\)"):
        assert_bytes_equal(a, b, "one ulp")
    with pytest.raises(AssertionError, match="dtype"):
        assert_bytes_equal(a, a.double(), "dtype")
    nan = torch.tensor([float("nan")])
    assert_bytes_equal(nan, nan.clone(), "same NaN bits are equal bytes")
    # A row-wise op that (slightly) depends on its batch-mates.
    leaky = rows_op(lambda x: x + 1e-3 * x.sum(dim=0, keepdim=True))
    with pytest.raises(AssertionError, match="vs alone"):
        check_row_invariance(leaky, lambda gen: randn(K, gen=gen), batch_sizes=(2,))
    # A parameter gradient that depends on the batch: the fold check must see it.
    w = randn(N, K, gen=generator(1))
    gen = generator(2)
    items = [randn(n, K, gen=gen) for n in (5, 33)]
    gouts = [randn(n, N, gen=gen) for n in (5, 33)]

    def batch_scaled(bt, p):
        seq = tuple(t.shape[0] for t in bt)
        return _split(cpu_gemm.gemm(torch.cat(bt), p[0] * (1 + 1e-3 * len(bt)), None, seqlens=seq), seq)

    with pytest.raises(AssertionError, match="batch grad vs fold of singletons|grad, batch vs fold"):
        check_param_grad_fold(batch_scaled, items, [w], gouts, what="batch-scaled weight")
    with pytest.raises(AssertionError, match="bad-input checks failed"):
        check_bad_inputs(lambda x: x, [BadCase("accepts anything", (1,), {}, "never")])
    with pytest.raises(AssertionError, match="vs FP64 reference"):
        check_grad_accuracy(lambda x: x * (1 + 1e-3), lambda x: x, [a], tol("gemm"), what="scaled copy")

"""FP32 scalar math of the strict GEMM engine's prologues and epilogues, from IEEE operations only.

Every function here is a ``@triton.jit`` helper inlined into the kernels (:mod:`.kernels`): ``+ - *``,
the fused multiply-add ``tl.fma`` (one rounding, written explicitly) and integer bit operations — no
``ex2.approx``/``__expf``, no ``rcp.approx``/``div.full``. The kernels compile with
``enable_fp_fusion=False``, so every operation is one IEEE-rounded FP32 operation in the order
written, and the interpreter (numpy FP32) executes the same sequence.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .codes import ACT_GELU_TANH

# The kernels write their constants as literals (a jit function reads no Python globals):
# log2(e) = 1.4426950408889634; ln2 = 0.693145751953125 (hi, 0x3f317200: n·hi is exact for |n| < 2⁹)
# + 1.428606765330187045e-06 (lo); GELU 2·√(2/π) = 1.5957691216057308, a = 0.044715, 3a = 0.134145.


@triton.jit
def _exp_clamped_f32(x):
    """exp(clamp(x, −86, 86)) in FP32 from IEEE operations only (``+ - *``, the fused multiply-add
    ``fma``, integer bit operations): the ``e`` of the activations' denominators ``1 + e``.

    k = fma(x, log2e, 1.5·2²³) rounds x·log2e to the nearest integer n in its low mantissa bits
    (n = k − 1.5·2²³, exact; no float-to-int conversion); r = fma(n, −ln2_hi, x); r = fma(n, −ln2_lo, r)
    (Cody–Waite, |r| ≤ 0.35); exp(r) by the degree-7 Taylor polynomial in Horner form, one ``fma``
    per degree (truncation < 0.1 ulp); times 2ⁿ, built from k's bits (n in [−124, 124]: the product
    is a normal number, exact). The clamp: below −86, 1 + e rounds to 1 anyway; the upper
    bound keeps 1 + e < 2¹²⁵, the range of :func:`_div_ge1_f32` (for GELU that is z < −9.8 and for
    SiLU z < −86, where the activation is below 2⁻¹²⁴·|z| in magnitude). ``fma`` is IEEE 754's
    fusedMultiplyAdd (one rounding), written explicitly: it is not a contraction (kernels compile
    with ``enable_fp_fusion=False``) and not an approximate intrinsic.
    """
    x = tl.minimum(tl.maximum(x, -86.0), 86.0)
    k = tl.fma(x, 1.4426950408889634, 12582912.0)
    n = k - 12582912.0
    r = tl.fma(n, -0.693145751953125, x)
    r = tl.fma(n, -1.428606765330187045e-06, r)
    p = tl.fma(r, 1.0 / 5040.0, 1.0 / 720.0)
    p = tl.fma(p, r, 1.0 / 120.0)
    p = tl.fma(p, r, 1.0 / 24.0)
    p = tl.fma(p, r, 1.0 / 6.0)
    p = tl.fma(p, r, 0.5)
    p = tl.fma(p, r, 1.0)
    p = tl.fma(p, r, 1.0)
    # bits(k) = 0x4B400000 + n, so (bits(k) − 0x4B400000 + 127) << 23 is the exponent field of 2ⁿ
    return p * ((k.to(tl.int32, bitcast=True) - 1262485377) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _div_ge1_f32(n, d):
    """n / d for 1 ≤ d < 2¹²⁵ from IEEE ``- * fma`` and one integer subtraction: no ``rcp.approx``, no
    ``div.full`` and no ``div.rn`` (whose out-of-line slow path makes the GELU epilogue spill registers
    on sm_90: 255 registers / 18 spilled vs 200 / 0; experiments/gemm/NOTES.md).

    y₀ = bits⁻¹(0x7EF311C3 − bits(d)) (|y₀·d − 1| < 0.13), three Newton steps
    y = fma(fma(−d, y, 1), y, y) (|y·d − 1| ≤ 6e-8), then q = n·y and one residual correction
    q = fma(−fma(d, q, −n), y, q). Equal to the correctly rounded quotient on every pair tested
    (12·10⁶ random pairs with d in [1, e⁸⁰]; the CI test checks 65 536 in the interpreter). The
    callers keep d < 2¹²⁵ (beyond it y₀ would be subnormal); a non-finite n gives NaN.
    """
    y = (2129859011 - d.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)  # 0x7EF311C3
    y = tl.fma(tl.fma(-d, y, 1.0), y, y)
    y = tl.fma(tl.fma(-d, y, 1.0), y, y)
    y = tl.fma(tl.fma(-d, y, 1.0), y, y)
    q = n * y
    return tl.fma(-tl.fma(d, q, -n), y, q)  # residual n − d·q as −(d·q − n): keeps the sign of a zero n


@triton.jit
def _sigmoid_f32(t):
    """σ(t) = 1 / (1 + exp(−t)), the division by :func:`_div_ge1_f32`."""
    one = tl.full(t.shape, 1.0, tl.float32)
    return _div_ge1_f32(one, one + _exp_clamped_f32(-t))


@triton.jit
def _act_f32(z, ACT: tl.constexpr):
    """ACT_GELU_TANH: gelu_tanh(z) = z / (1 + exp(−t)), t = 2c·fma(z³, a, z) (= ½z(1 + tanh(c(z + a z³))),
    c = √(2/π), a = 0.044715); ACT_SILU: silu(z) = z / (1 + exp(−z)). One division (:func:`_div_ge1_f32`)
    of z by 1 + exp(−t) — the same function as z·σ(t) with one rounding fewer. Operation order as
    written; every step one IEEE FP32 rounding."""
    if ACT == ACT_GELU_TANH:
        t = tl.fma((z * z) * z, 0.044715, z) * 1.5957691216057308
        return _div_ge1_f32(z, 1.0 + _exp_clamped_f32(-t))
    else:
        return _div_ge1_f32(z, 1.0 + _exp_clamped_f32(-z))


@triton.jit
def _act_grad_f32(z, ACT: tl.constexpr):
    """d act / dz.  gelu_tanh: s + z·s·(1−s)·2c(1 + 3a z²) with s = σ(2c(z + a z³));
    silu: s·(1 + z·(1 − s)) with s = σ(z)."""
    if ACT == ACT_GELU_TANH:
        t = tl.fma((z * z) * z, 0.044715, z) * 1.5957691216057308
        s = _sigmoid_f32(t)
        dt = tl.fma(z * z, 0.134145, 1.0) * 1.5957691216057308
        return s + ((z * s) * (1.0 - s)) * dt
    else:
        s = _sigmoid_f32(z)
        return s * (z * (1.0 - s) + 1.0)

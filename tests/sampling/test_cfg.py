"""cfg_combine_renorm: parity with diffusers' formula and FP64, batch invariance in bytes, tree_sum, bad inputs."""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.reference.sampling import diffusers_cfg_formula_fp32, ref_cfg_combine
from mmdit_strict.sampling import cfg_combine, tree_sum
from mmdit_strict.sampling.tree import sqrt_rn
from mmdit_strict.tolerances import tolerance

SCALES = (1.0, 2.5, 4.0, 7.5)


def _pair(batch: int, tokens: int, seed: int = 0, channels: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cond = torch.randn(batch, tokens, channels, generator=g)
    neg = torch.randn(batch, tokens, channels, generator=g) * 1.3 + 0.2
    return cond, neg


@pytest.mark.parametrize("scale", SCALES)
def test_cfg_matches_diffusers_formula(scale):
    tol = tolerance("sampling", "cfg_vs_diffusers", torch.float32)
    cond, neg = _pair(4, 257)
    ok, max_abs, max_rel = tol.check(cfg_combine(cond, neg, scale), diffusers_cfg_formula_fp32(cond, neg, scale))
    assert ok, f"max abs {max_abs} max rel {max_rel}"


@pytest.mark.parametrize("scale", SCALES)
def test_cfg_matches_fp64_reference(scale):
    tol = tolerance("sampling", "cfg_vs_fp64", torch.float32)
    cond, neg = _pair(3, 129, seed=1)
    ok, max_abs, max_rel = tol.check(cfg_combine(cond, neg, scale), ref_cfg_combine(cond, neg, scale))
    assert ok, f"max abs {max_abs} max rel {max_rel}"


def test_cfg_output_norm_equals_cond_norm():
    cond, neg = _pair(2, 33, seed=2)
    out = cfg_combine(cond, neg, 4.0)
    ok, max_abs, _ = tolerance("sampling", "cfg_renorm_norm", torch.float32).check(out.double().norm(dim=-1), cond.double().norm(dim=-1))
    assert ok, max_abs


@pytest.mark.parametrize("batch", [1, 3, 64])
def test_cfg_batch_invariant_bytes(batch):
    cond, neg = _pair(batch, 45, seed=3)
    full = cfg_combine(cond, neg, 4.0)
    rev = cfg_combine(cond.flip(0), neg.flip(0), 4.0).flip(0)
    assert torch.equal(full, rev)
    for i in {0, batch // 2, batch - 1}:
        alone = cfg_combine(cond[i : i + 1], neg[i : i + 1], 4.0)
        assert torch.equal(alone, full[i : i + 1]), f"row {i} differs alone vs in a batch of {batch}"


def test_cfg_token_count_invariant_bytes():
    cond, neg = _pair(1, 300, seed=4)
    full = cfg_combine(cond, neg, 2.5)
    assert torch.equal(cfg_combine(cond[:, 7:19], neg[:, 7:19], 2.5), full[:, 7:19])
    flat = cfg_combine(cond.reshape(300, 64), neg.reshape(300, 64), 2.5)
    assert torch.equal(flat, full.reshape(300, 64))


def test_cfg_zero_combination_stays_zero_and_has_finite_grad():
    cond = torch.randn(1, 2, 64, requires_grad=True)
    neg = cond.detach().clone()
    neg[0, 1] = 1.0
    out = cfg_combine(cond, neg, 1.0)  # token 0: neg == cond, so comb == cond
    assert torch.isfinite(out).all()
    z = torch.zeros(1, 1, 64)
    assert torch.equal(cfg_combine(z, z, 3.0), z)
    out.sum().backward()
    assert torch.isfinite(cond.grad).all()


def test_cfg_is_differentiable():
    cond, neg = _pair(2, 5, seed=5)
    cond.requires_grad_()
    neg.requires_grad_()
    cfg_combine(cond, neg, 4.0).pow(2).sum().backward()
    # sum(out^2) = sum over tokens of ||cond||^2 (the renorm fixes each token's norm), so the gradient is
    # 2 * cond for cond and 0 for neg.
    tol = tolerance("sampling", "cfg_grad_identity", torch.float32)
    for got, want in ((cond.grad, 2 * cond.detach()), (neg.grad, torch.zeros_like(neg))):
        ok, max_abs, _ = tol.check(got, want)
        assert ok, max_abs


def test_cfg_gradient_batch_invariant_bytes():
    cond, neg = _pair(6, 17, seed=8)
    up = torch.randn(cond.shape, generator=torch.Generator().manual_seed(9))
    c, n = cond.clone().requires_grad_(), neg.clone().requires_grad_()
    (cfg_combine(c, n, 4.0) * up).sum().backward()
    for i in (0, 3, 5):
        ci, ni = cond[i : i + 1].clone().requires_grad_(), neg[i : i + 1].clone().requires_grad_()
        (cfg_combine(ci, ni, 4.0) * up[i : i + 1]).sum().backward()
        assert torch.equal(ci.grad, c.grad[i : i + 1]) and torch.equal(ni.grad, n.grad[i : i + 1])


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 63, 64, 65, 100])
def test_tree_sum_fixed_order_and_value(n):
    x = torch.randn(7, n, dtype=torch.float32)
    s = tree_sum(x, dim=-1)
    ok, max_abs, _ = tolerance("sampling", "tree_sum_vs_fp64", torch.float32).check(s.double(), x.double().sum(-1))
    assert ok, max_abs
    # the documented order, written out: zero-pad to a power of two, then halve
    p = 1
    while p < n:
        p *= 2
    y = [list(row) for row in torch.cat([x, torch.zeros(7, p - n)], dim=1)]
    while p > 1:
        p //= 2
        y = [[r[i] + r[i + p] for i in range(p)] for r in y]  # 0-d FP32 adds, one at a time
    assert torch.equal(s, torch.stack([r[0] for r in y]).reshape(7))
    assert torch.equal(tree_sum(x[2:3], dim=-1), s[2:3])
    assert tree_sum(x.t(), dim=0, keepdim=True).shape == (1, 7)


def test_tree_sum_bad_inputs():
    with pytest.raises(ValueError, match="floating"):
        tree_sum(torch.arange(4))
    with pytest.raises(ValueError, match="out of range"):
        tree_sum(torch.ones(3), dim=2)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda c, n: (c, n[:, :-1]), "same shape"),
        (lambda c, n: (c.double(), n.double()), "must be float32"),
        (lambda c, n: (c.bfloat16(), n), "must be float32"),
        (lambda c, n: (c.masked_fill(c > 2, float("nan")), n), "cond contains NaN or Inf"),
        (lambda c, n: (c, n.masked_fill(n > 2, float("inf"))), "neg contains NaN or Inf"),
    ],
)
def test_cfg_bad_inputs(make, match):
    cond, neg = _pair(2, 10, seed=6)
    c, n = make(cond, neg)
    with pytest.raises(ValueError, match=match):
        cfg_combine(c, n, 4.0)


def test_cfg_bad_scale():
    cond, neg = _pair(1, 3)
    with pytest.raises(ValueError, match="finite"):
        cfg_combine(cond, neg, float("nan"))
    with pytest.raises(TypeError, match="scale"):
        cfg_combine(cond, neg, torch.tensor(4.0))


def test_sqrt_rn_is_correctly_rounded():
    import numpy as np

    g = torch.Generator().manual_seed(7)
    x = torch.cat(
        [
            torch.rand(200_000, generator=g) * 1000,
            torch.rand(100_000, generator=g) * 1e-30,
            torch.tensor([0.0, 1e-45, 1.17549435e-38, 0.25, 1.0, 2.0, 4.0, 3.4028235e38, 16777215.0, 16777216.0]),
            torch.randint(0, 2**24, (50_000,), generator=g).float() ** 2,  # exact squares
        ]
    )
    expected = torch.from_numpy(np.sqrt(x.numpy()))  # IEEE sqrt (round to nearest even)
    assert torch.equal(sqrt_rn(x), expected)
    assert torch.equal(sqrt_rn(x[17:18]), expected[17:18])
    xg = x[:5].clone().requires_grad_()
    sqrt_rn(xg).sum().backward()
    ok, max_abs, _ = tolerance("sampling", "sqrt_rn_grad", torch.float32).check(xg.grad, 0.5 / torch.sqrt(x[:5].double()).float())
    assert ok, max_abs
    with pytest.raises(ValueError, match="float32"):
        sqrt_rn(x.double())

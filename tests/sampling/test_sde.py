"""flow_sde_step_logp + Euler step: FP64 reference, diffusers byte parity, batch invariance, dlogp, bad inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mmdit_strict.reference.sampling import ref_gaussian_kl, ref_sde_step
from mmdit_strict.sampling import SDEStepResult, euler_step, gaussian_kl, sde_step, sigma_table
from mmdit_strict.tolerances import tolerance

N_STEPS = 10
TABLE = sigma_table(N_STEPS, 4096)
SIGMA_MAX = float(TABLE[1])
STEPS = [(float(TABLE[i]), float(TABLE[i + 1])) for i in range(N_STEPS)]


def _tensors(shape, seed, n=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]


def _check(check, actual, expected):
    tol = tolerance("sampling", check, torch.float32)
    ok, max_abs, max_rel = tol.check(actual, expected)
    assert ok, f"{check}: max abs {max_abs:.3e} max rel {max_rel:.3e} (bound rtol {tol.rtol} atol {tol.atol})"


@pytest.mark.parametrize("step", range(N_STEPS))
def test_sde_matches_fp64_reference(step):
    s, sp = STEPS[step]
    v, x, noise = _tensors((3, 97, 64), seed=step)
    out = sde_step(v, x, s, sp, noise=noise, sigma_max=SIGMA_MAX)
    assert isinstance(out, SDEStepResult)
    assert out.logp.shape == (3,) and out.std.shape == (3,) and out.mean.shape == x.shape
    assert all(t.dtype == torch.float32 for t in out)
    ref = ref_sde_step(v, x, s, sp, sigma_max=SIGMA_MAX, noise=noise)
    _check("sde_mean_vs_fp64", out.mean, ref["mean"])
    _check("sde_x_prev_vs_fp64", out.x_prev, ref["x_prev"])
    _check("sde_std_vs_fp64", out.std, ref["std"])
    _check("sde_logp_vs_fp64", out.logp, ref["logp"])
    ref_recompute = ref_sde_step(v, x, s, sp, sigma_max=SIGMA_MAX, prev_sample=out.x_prev)
    _check("sde_logp_vs_fp64", out.logp, ref_recompute["logp"])


def test_sde_per_sample_sigmas_match_scalar_calls():
    v, x, noise = _tensors((3, 20, 64), seed=11)
    sig = TABLE[[0, 4, 9]]
    sig_prev = TABLE[[1, 5, 10]]
    batched = sde_step(v, x, sig, sig_prev, noise=noise, sigma_max=SIGMA_MAX)
    for i, k in enumerate([0, 4, 9]):
        alone = sde_step(v[i : i + 1], x[i : i + 1], TABLE[k], TABLE[k + 1], noise=noise[i : i + 1], sigma_max=SIGMA_MAX)
        for a, b in zip(alone, batched):
            assert torch.equal(a, b[i : i + 1])


@pytest.mark.parametrize("batch", [1, 3, 64])
def test_sde_batch_invariant_bytes(batch):
    s, sp = STEPS[7]
    v, x, noise = _tensors((batch, 16, 64), seed=batch)
    full = sde_step(v, x, s, sp, noise=noise, sigma_max=SIGMA_MAX)
    rev = sde_step(v.flip(0), x.flip(0), s, sp, noise=noise.flip(0), sigma_max=SIGMA_MAX)
    for a, b in zip(full, rev):
        assert torch.equal(a, b.flip(0))
    for i in {0, batch // 2, batch - 1}:
        alone = sde_step(v[i : i + 1], x[i : i + 1], s, sp, noise=noise[i : i + 1], sigma_max=SIGMA_MAX)
        for a, b in zip(alone, full):
            assert torch.equal(a, b[i : i + 1]), f"sample {i} differs alone vs batch of {batch}"


def test_recompute_path_reproduces_rollout_logp_bytes():
    """The logp the training side recomputes equals, byte for byte, the logp the rollout recorded —
    from two different producers: the rollout steps a whole batch at one sigma (Python floats) through
    ``trajectories.rollout.step_latents`` with keyed noise; the recompute evaluates shuffled micro-batches
    of (sample, step) pairs mixing steps, each pair at its own sigma (``(B,)`` tensors, as training's
    ``evaluate_pairs`` does), from the recorded ``x_t`` and ``x_{t+1}`` in fresh storage — never from the
    rollout's own tensors or its noise."""
    from mmdit_strict.config.schema import SamplerConfig
    from mmdit_strict.trajectories.rollout import step_latents

    sampler, seed = SamplerConfig(sde=True, eta=0.7), 7
    B, T, C = 4, 33, 64
    ids = [3, 0, 11, 5]
    sigmas = TABLE
    x = torch.randn(B, T, C, generator=torch.Generator().manual_seed(21))
    vs, xs, logps = [], [x], []
    for step in range(N_STEPS):  # rollout: the whole batch per step; v stands in for the model's velocity
        v = 1.3 * torch.randn(B, T, C, generator=torch.Generator().manual_seed(100 + step))
        x, logp = step_latents(sampler, seed, v, x, sigmas, step, ids)
        vs.append(v)
        xs.append(x)
        logps.append(logp)
    record_x = torch.stack(xs).clone()  # (S + 1, B, T, C), what the artifact stores
    record_v = torch.stack(vs).clone()
    pairs = [(n, st) for n in range(B) for st in range(N_STEPS)]
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(5)).tolist()
    for chunk in (order[i:i + 3] for i in range(0, len(order), 3)):
        mb = [pairs[i] for i in chunk]
        steps = [st for _, st in mb]
        x_t = torch.stack([record_x[st, n] for n, st in mb])
        x_next = torch.stack([record_x[st + 1, n] for n, st in mb])
        v = torch.stack([record_v[st, n] for n, st in mb]).requires_grad_()
        res = sde_step(v, x_t, sigmas[steps].contiguous(), sigmas[[st + 1 for st in steps]].contiguous(),
                       prev_sample=x_next, eta=0.7, sigma_max=float(sigmas[1]))
        for j, (n, st) in enumerate(mb):
            assert torch.equal(res.logp[j], logps[st][n]), f"sample {n} step {st}: recomputed logp differs from the rollout's"
        ratio = torch.exp(res.logp - torch.stack([logps[st][n] for n, st in mb]))
        assert torch.equal(ratio, torch.ones_like(ratio))


@pytest.mark.parametrize("step", [0, 4, N_STEPS - 1])
def test_dlogp_dv_matches_fp64_finite_differences(step):
    s, sp = STEPS[step]
    v, x, noise = _tensors((2, 3, 8), seed=30 + step)
    v = v.requires_grad_()
    out = sde_step(v, x, s, sp, noise=noise, sigma_max=SIGMA_MAX)
    (grad,) = torch.autograd.grad(out.logp.sum(), v)
    assert torch.isfinite(grad).all()
    x_prev = out.x_prev.detach()
    v64 = v.detach().double()
    fd = torch.empty_like(v64)
    h = 1e-6
    for idx in range(v64.numel()):
        e = torch.zeros(v64.numel(), dtype=torch.float64)
        e[idx] = h
        e = e.view_as(v64)
        hi = ref_sde_step(v64 + e, x, s, sp, sigma_max=SIGMA_MAX, prev_sample=x_prev)["logp"].sum()
        lo = ref_sde_step(v64 - e, x, s, sp, sigma_max=SIGMA_MAX, prev_sample=x_prev)["logp"].sum()
        fd.view(-1)[idx] = (hi - lo) / (2 * h)
    _check("sde_dlogp_dv_vs_fp64_fd", grad, fd)


def test_dlogp_batch_invariant_bytes():
    s, sp = STEPS[3]
    v, x, noise = _tensors((5, 12, 64), seed=40)
    x_prev = sde_step(v, x, s, sp, noise=noise, sigma_max=SIGMA_MAX).x_prev
    vb = v.clone().requires_grad_()
    sde_step(vb, x, s, sp, prev_sample=x_prev, sigma_max=SIGMA_MAX).logp.sum().backward()
    for i in (0, 2, 4):
        vi = v[i : i + 1].clone().requires_grad_()
        sde_step(vi, x[i : i + 1], s, sp, prev_sample=x_prev[i : i + 1], sigma_max=SIGMA_MAX).logp.sum().backward()
        assert torch.equal(vi.grad, vb.grad[i : i + 1])


def test_last_step_to_zero_is_finite():
    s, sp = STEPS[-1]
    assert sp == 0.0
    v, x, noise = _tensors((2, 8, 64), seed=50)
    out = sde_step(v, x, s, sp, noise=noise, sigma_max=SIGMA_MAX)
    assert all(torch.isfinite(t).all() for t in out)


def test_single_step_schedule_uses_sigma_max_branch():
    table = sigma_table(1, 4096)
    v, x, noise = _tensors((2, 8, 64), seed=51)
    out = sde_step(v, x, float(table[0]), float(table[1]), noise=noise, sigma_max=float(table[1]), eta=0.7)
    assert torch.equal(out.std, torch.full((2,), 0.7))
    assert all(torch.isfinite(t).all() for t in out)


def test_euler_step_bytes_equal_diffusers():
    diffusers = pytest.importorskip("diffusers")
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    sched = diffusers.FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, num_train_timesteps=1000,
        shift=1.0, shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True,
    )
    n = 13
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=calculate_shift(6032, 256, 8192, 0.5, 0.9))
    table = sigma_table(n, 6032)
    assert torch.equal(sched.sigmas, table)
    g = torch.Generator().manual_seed(60)
    ours = theirs = torch.randn(2, 6032 // 64, 64, generator=g)
    for i, t in enumerate(sched.timesteps):
        v = torch.randn(ours.shape, generator=g) * 1.7
        theirs = sched.step(v, t, theirs, return_dict=False)[0]
        ours = euler_step(v, ours, float(table[i]), float(table[i + 1]))
        assert torch.equal(ours, theirs), f"step {i}"


def test_gaussian_kl_matches_fp64_and_is_batch_invariant():
    a, noise = _tensors((4, 40, 64), seed=70, n=2)
    b = a + 0.01 * noise
    std = sde_step(a, a, *STEPS[2], noise=noise, sigma_max=SIGMA_MAX).std
    kl = gaussian_kl(a, b, std)
    _check("gaussian_kl_vs_fp64", kl, ref_gaussian_kl(a, b, std))
    assert torch.equal(gaussian_kl(a[1:2], b[1:2], std[1:2]), kl[1:2])
    assert torch.equal(gaussian_kl(a, a, 0.5), torch.zeros(4))


def _bad(**over):
    v, x, noise = _tensors((2, 4, 64), seed=80)
    kw = dict(v=v, x=x, sigma=STEPS[2][0], sigma_prev=STEPS[2][1], noise=noise, sigma_max=SIGMA_MAX)
    kw.update(over)
    return kw


@pytest.mark.parametrize(
    "over,match",
    [
        ({"v": torch.randn(2, 4, 63)}, "v must have the shape of x"),
        ({"v": torch.randn(2, 4, 64, dtype=torch.float64)}, "v must be float32"),
        ({"x": torch.randn(2, 4, 64).bfloat16()}, "x must be float32"),
        ({"v": torch.full((2, 4, 64), float("nan"))}, "v contains NaN or Inf"),
        ({"x": torch.full((2, 4, 64), float("inf"))}, "x contains NaN or Inf"),
        ({"noise": torch.full((2, 4, 64), float("nan"))}, "noise contains NaN or Inf"),
        ({"sigma": 0.5, "sigma_prev": 0.6}, "sigma_prev must be < sigma"),
        ({"sigma": 0.5, "sigma_prev": 0.5}, "sigma_prev must be < sigma"),
        ({"sigma": 0.0, "sigma_prev": 0.0}, r"sigma must be in \(0, 1\]"),
        ({"sigma": -0.1}, r"sigma must be in \(0, 1\]"),
        ({"sigma": 1.5}, r"sigma must be in \(0, 1\]"),
        ({"sigma_prev": -0.01}, "sigma_prev must be >= 0"),
        ({"sigma": float("nan")}, "sigma contains NaN"),
        ({"sigma": torch.tensor([0.5, 0.4, 0.3])}, r"a \(2,\) tensor"),
        ({"sigma": torch.tensor(0.5, dtype=torch.float64)}, "must be float32"),
        ({"eta": 0.0}, "eta must be"),
        ({"sigma_max": 1.0}, "sigma_max must be"),
        ({"prev_sample": torch.randn(2, 4, 64)}, "exactly one of"),
        ({"noise": None}, "exactly one of"),
    ],
)
def test_sde_bad_inputs(over, match):
    kw = _bad(**over)
    with pytest.raises((ValueError, TypeError), match=match):
        sde_step(kw.pop("v"), kw.pop("x"), kw.pop("sigma"), kw.pop("sigma_prev"), **kw)


def test_euler_bad_inputs():
    v, x, _ = _tensors((2, 4, 64), seed=81)
    with pytest.raises(ValueError, match="sigma_prev must be < sigma"):
        euler_step(v, x, 0.3, 0.4)
    with pytest.raises(ValueError, match="v must have the shape of x"):
        euler_step(v[:1], x, 0.4, 0.3)
    with pytest.raises(ValueError, match="x must have shape"):
        euler_step(v[0, 0], x[0, 0], 0.4, 0.3)
    assert math.isfinite(float(euler_step(v, x, 0.4, 0.0).sum()))

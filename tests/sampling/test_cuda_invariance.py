"""The sampling operators registered ``torch_fixed`` for CUDA keep their bytes whatever the batch.

CUDA's elementwise and reduction kernels choose launch geometry (and, for reductions, the summation
order) from the tensor's shape; the strict sampling math uses elementwise ops and the fixed pairwise
tree only, so a sample's bytes must not depend on batch size, position or what it is batched with.
Checked here on the GPU (``python -m pytest -m gpu tests/sampling/test_cuda_invariance.py``) with the
harness: every sample of batches of 2, 3, 8 and 64 (every position, reversed, a probe first / middle /
last) against the sample alone, and a token prefix alone against the same tokens inside a longer sample.
"""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.config.arch import QWEN_LATENTS_MEAN, QWEN_LATENTS_STD
from mmdit_strict.sampling.cfg import cfg_combine
from mmdit_strict.sampling.latents import denormalize_latents, normalize_latents, pack_latents, unpack_latents
from mmdit_strict.sampling.sde import sde_step
from tests.harness import Target, assert_bytes_equal, check_row_invariance, generator, randn, rows_op

CUDA = Target("cuda", torch.float32)
BATCHES = (2, 3, 8, 64)
TOKENS, CH = 1024, 64  # a 64x64 latent grid packed 2x2: 1024 tokens of 64 values


def _gpu() -> None:
    CUDA.skip_unless_available()


@pytest.mark.gpu
def test_cfg_combine_bytes_do_not_depend_on_the_batch():
    _gpu()

    def item(gen):
        return (randn(TOKENS, CH, gen=gen), randn(TOKENS, CH, gen=gen))

    check_row_invariance(rows_op(lambda c, n: cfg_combine(c, n, 4.0)), item, BATCHES, target=CUDA, what="cfg_combine cuda")
    c, n = (randn(1, TOKENS, CH, gen=generator(3), target=CUDA) for _ in range(2))
    full = cfg_combine(c, n, 4.0)
    for k in (1, 7, 333):
        assert_bytes_equal(cfg_combine(c[:, :k].contiguous(), n[:, :k].contiguous(), 4.0), full[:, :k], f"cfg_combine first {k} tokens")


@pytest.mark.gpu
def test_sde_step_and_logp_gradient_bytes_do_not_depend_on_the_batch():
    """Rollout (noise) and recompute (prev_sample) paths: x_prev, logp, mean and dlogp/dv per sample."""
    _gpu()

    def item(gen):
        return (randn(TOKENS, CH, gen=gen), randn(TOKENS, CH, gen=gen), randn(TOKENS, CH, gen=gen),
                torch.rand((), generator=gen) * 0.9 + 0.05)

    def step(v, x, noise, sigma):
        res = sde_step(v, x, sigma, sigma * 0.9, noise=noise, sigma_max=0.99)
        v2 = v.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            rec = sde_step(v2, x, sigma, sigma * 0.9, prev_sample=res.x_prev, sigma_max=0.99)
            (dv,) = torch.autograd.grad(rec.logp.sum(), v2)
        return res.x_prev, res.logp, res.mean, rec.logp, dv

    check_row_invariance(rows_op(step), item, BATCHES, target=CUDA, what="sde_step cuda")


@pytest.mark.gpu
def test_latent_normalize_and_pack_bytes_do_not_depend_on_the_batch():
    _gpu()

    def item(gen):
        return randn(16, 64, 64, gen=gen, scale=3.0)

    def run(z):
        x = normalize_latents(z, QWEN_LATENTS_MEAN, QWEN_LATENTS_STD)
        p = pack_latents(x)
        return x, p, denormalize_latents(unpack_latents(p, 64, 64), QWEN_LATENTS_MEAN, QWEN_LATENTS_STD)

    check_row_invariance(rows_op(run), item, BATCHES, target=CUDA, what="latent normalize/pack cuda")

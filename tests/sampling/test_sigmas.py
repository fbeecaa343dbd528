"""flow_sigma_table: byte parity with diffusers' FlowMatchEulerDiscreteScheduler, FP64 reference, bad inputs."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from mmdit_strict.reference.sampling import ref_mu, ref_sigma_table
from mmdit_strict.sampling import mu_for, sigma_table
from mmdit_strict.tolerances import tolerance

diffusers = pytest.importorskip("diffusers")
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift  # noqa: E402

SEQ_LENS = (1, 16, 64, 255, 256, 257, 1000, 4096, 6032, 6889, 8192, 9000)


@pytest.fixture(scope="module")
def scheduler():
    return diffusers.FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=8192,
        max_shift=0.9,
        num_train_timesteps=1000,
        shift=1.0,
        shift_terminal=0.02,
        time_shift_type="exponential",
        use_dynamic_shifting=True,
    )


def _diffusers_sigmas(scheduler, n: int, seq_len: int) -> torch.Tensor:
    mu = calculate_shift(seq_len, 256, 8192, 0.5, 0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # N = 1 divides 0 by 0 inside diffusers
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
    return scheduler.sigmas.clone()


@pytest.mark.parametrize("seq_len", SEQ_LENS)
def test_mu_matches_diffusers_calculate_shift(seq_len):
    assert mu_for(seq_len) == calculate_shift(seq_len, 256, 8192, 0.5, 0.9)


@pytest.mark.parametrize("seq_len", SEQ_LENS)
def test_sigma_table_bytes_equal_diffusers(scheduler, seq_len):
    for n in range(2, 61):
        ours = sigma_table(n, seq_len)
        theirs = _diffusers_sigmas(scheduler, n, seq_len)
        assert ours.dtype == torch.float32 and ours.shape == (n + 1,)
        assert torch.equal(ours, theirs), f"N={n} seq_len={seq_len}: max diff {(ours - theirs).abs().max()}"


def test_single_step_is_one_then_zero_where_diffusers_gives_nan(scheduler):
    theirs = _diffusers_sigmas(scheduler, 1, 4096)
    assert torch.isnan(theirs[0]), "diffusers changed its N=1 behaviour; revisit the documented difference"
    assert torch.equal(sigma_table(1, 4096), torch.tensor([1.0, 0.0]))


@pytest.mark.parametrize("n,seq_len", [(2, 16), (10, 4096), (28, 6889), (50, 6032), (60, 9000)])
def test_sigma_table_vs_fp64_reference(n, seq_len):
    tol = tolerance("sampling", "sigma_vs_fp64", torch.float32)
    assert ref_mu(seq_len) == pytest.approx(mu_for(seq_len), rel=1e-12)
    ours = sigma_table(n, seq_len)
    ok, max_abs, _ = tol.check(ours, ref_sigma_table(n, seq_len))
    assert ok, f"max abs {max_abs}"
    assert ours[0] == 1.0 and ours[-1] == 0.0 and torch.all(ours[:-1] > ours[1:])
    assert ours[-2] == pytest.approx(0.02, abs=1e-6)


def test_sigma_table_device_argument():
    assert torch.equal(sigma_table(7, 1000, device="cpu"), sigma_table(7, 1000))


@pytest.mark.parametrize(
    "args,exc,match",
    [
        ((0, 4096), ValueError, "num_steps must be >= 1"),
        ((-3, 4096), ValueError, "num_steps must be >= 1"),
        ((10, 0), ValueError, "image_seq_len must be >= 1"),
        ((10.0, 4096), TypeError, "num_steps must be an int"),
        ((10, 4096.5), TypeError, "image_seq_len must be an int"),
        ((True, 4096), TypeError, "num_steps must be an int"),
    ],
)
def test_sigma_table_bad_inputs(args, exc, match):
    with pytest.raises(exc, match=match):
        sigma_table(*args)


def test_sigma_table_bad_shift_terminal():
    with pytest.raises(ValueError, match="shift_terminal"):
        sigma_table(10, 4096, shift_terminal=1.0)

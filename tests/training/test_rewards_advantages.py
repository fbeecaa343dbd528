"""Rewards registry, built-ins, weighted sums and GRPO advantages."""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.training.advantages import STD_EPS, StatTracker
from mmdit_strict.training.loss import grpo_loss
from mmdit_strict.sampling import pack_latents
from mmdit_strict.training.rewards import ImageSource, RewardSet, available_rewards, unpack_final
from mmdit_strict.training.rollout import epoch_prompts, plan_epoch, window_start
from mmdit_strict.config.training import SampleConfig


def _latents(B: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(B, 16, 8, 8, generator=torch.Generator().manual_seed(seed))


def _call(rs: RewardSet, z: torch.Tensor, prompts=None, meta=None):
    """Rewards of unpacked ``(B, 16, H, W)`` latents (packed as the model produces them)."""
    B = z.shape[0]
    return rs(pack_latents(z), (z.shape[2] // 2, z.shape[3] // 2), prompts or ["p"] * B, meta or [{}] * B)


def test_builtins_are_registered() -> None:
    assert {"jpeg_compressibility", "jpeg_incompressibility", "latent_stats"} <= set(available_rewards())


def test_jpeg_rewards_prefer_flat_images() -> None:
    z = _latents(2)
    z[0] = 0.0  # a flat image compresses far better than noise
    rs = RewardSet({"jpeg_compressibility": 1.0, "jpeg_incompressibility": 0.5})
    total, parts = _call(rs, z)
    c, i = parts["jpeg_compressibility"], parts["jpeg_incompressibility"]
    assert c[0] > c[1] and i[1] > i[0]
    assert torch.equal(c, -i)
    assert torch.equal(total, c + 0.5 * i)
    img = ImageSource()(pack_latents(z), (4, 4))
    assert img.shape == (2, 64, 64, 3) and img.dtype == torch.uint8  # one pixel per latent cell, ×8
    assert (img[0] == img[0, 0, 0]).all()  # a flat latent gives a flat image


def test_latent_stats_and_kwargs() -> None:
    z = torch.zeros(2, 16, 4, 4)
    z[1] += 0.5
    _, parts = _call(RewardSet({"latent_stats": 1.0}, {"latent_stats": {"mean": 0.5}}), z)
    assert parts["latent_stats"].tolist() == [-0.5, 0.0]


def test_plugins_and_zero_weights() -> None:
    z = _latents(2, seed=1)
    rs = RewardSet({"tests.training.plugin_reward:brightness": 2.0, "tests.training.plugin_reward:latent_abs": 1.0,
                    "latent_stats": 0.0}, {"tests.training.plugin_reward:latent_abs": {"scale": 3.0}})
    total, parts = _call(rs, z)
    assert set(parts) == {"tests.training.plugin_reward:brightness", "tests.training.plugin_reward:latent_abs"}
    want_abs = 3.0 * z.abs().flatten(1).mean(dim=1).double()
    assert torch.allclose(parts["tests.training.plugin_reward:latent_abs"], want_abs)


@pytest.mark.parametrize("weights, kwargs, match", [
    ({}, None, "no reward with a non-zero weight"),
    ({"latent_stats": 0.0}, None, "no reward with a non-zero weight"),
    ({"nope": 1.0}, None, "unknown reward 'nope'"),
    ({"no_such_module_xyz:f": 1.0}, None, "cannot import"),
    ({"tests.training.plugin_reward:missing": 1.0}, None, "no callable"),
    ({"latent_stats": 1.0}, {"jpeg_compressibility": {}}, "reward_kwargs names rewards not in"),
    ({"latent_stats": float("nan")}, None, "must be finite"),
])
def test_bad_reward_configs(weights, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        RewardSet(weights, kwargs)


def test_reward_output_is_checked() -> None:
    from mmdit_strict.training import rewards as R

    def bad(latents, prompts, metadata):
        return [float("nan")] * latents.shape[0]

    bad.takes = "latents"
    R._REGISTRY["_test_bad"] = R.RewardSpec("_test_bad", bad, "latents")
    try:
        with pytest.raises(ValueError, match="NaN or Inf"):
            _call(RewardSet({"_test_bad": 1.0}), _latents(2))
    finally:
        del R._REGISTRY["_test_bad"]


def test_unpack_matches_pack_layout() -> None:
    z = _latents(2)
    packed = pack_latents(z)
    assert torch.equal(unpack_final(packed, (4, 4)), z)


def test_per_prompt_advantages() -> None:
    r = torch.tensor([1.0, 3.0, 5.0, 5.0, 0.0, 2.0], dtype=torch.float64)
    ids = [0, 0, 1, 1, 2, 2]
    adv, stats = StatTracker(per_prompt=True).advantages(r, ids)
    assert torch.allclose(adv, torch.tensor([-1, 1, 0, 0, -1, 1], dtype=torch.float64) / (1 + STD_EPS))
    assert stats["zero_std_ratio"] == pytest.approx(1 / 3)
    adv_g, _ = StatTracker(per_prompt=False).advantages(r, ids)
    assert torch.allclose(adv_g, (r - r.mean()) / (r.std(unbiased=False) + STD_EPS))
    adv_s, _ = StatTracker(per_prompt=True, global_std=True).advantages(r, ids)
    assert torch.allclose(adv_s[:2], (r[:2] - 2.0) / (r.std(unbiased=False) + STD_EPS))


def test_grpo_loss_clips_like_flow_grpo() -> None:
    logp = torch.tensor([0.0, 0.5, -0.5], requires_grad=True)
    old = torch.zeros(3)
    adv = torch.tensor([1.0, 1.0, -10.0])
    out = grpo_loss(logp, old, adv, weight=1 / 3, clip_range=0.2, adv_clip_max=5.0)
    ratio = torch.exp(logp.detach())
    want = torch.stack([-1.0 * ratio[0], -1.0 * torch.clamp(ratio[1], 0.8, 1.2), torch.maximum(5.0 * ratio[2], 5.0 * torch.clamp(ratio[2], 0.8, 1.2))])
    assert torch.allclose(out.policy, want)
    assert out.clipped.tolist() == [False, True, True]
    out.loss.backward()
    assert logp.grad[1] == 0.0  # clipped on the profitable side: no gradient, as in PPO


def test_keyed_plans_are_reproducible() -> None:
    scfg = SampleConfig(num_steps=6, noise_level=0.7, guidance_scale=4.0, num_image_per_prompt=3, prompts_per_epoch=2,
                        same_latent=True, sde_window_size=2, sde_window_range=[1, 5])
    a = plan_epoch(0, 3, 5, scfg, 6)
    assert a == plan_epoch(0, 3, 5, scfg, 6)
    sids, pids, init_ids, starts, steps = a
    assert sids == list(range(18, 24)) and init_ids == [18, 18, 18, 21, 21, 21]
    assert all(1 <= s <= 3 for s in starts) and steps[0] == [starts[0], starts[0] + 1]
    # every prompt once per pass through the prompt set
    seen = [p for e in range(5) for p in epoch_prompts(0, e, 5, 2)]
    assert sorted(seen[:5]) == list(range(5)) and sorted(seen[5:10]) == list(range(5))
    with pytest.raises(ValueError, match="sde_window_range"):
        window_start(0, 0, 0, 6, 3, [4, 6])

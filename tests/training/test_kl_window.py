"""KL to the adapter-disabled reference, SDE windows, shared initial noise and inner epochs in the loop."""

from __future__ import annotations

import torch

from tests.training.conftest import compose_train
from mmdit_strict.training.loop import Trainer
from mmdit_strict.training.policy import adapters_disabled
from mmdit_strict.training.rollout import rollout_epoch, side
from tests.harness import assert_bytes_equal
from tests.training.conftest import SMALL


def _trainer(tmp_path, *extra: str) -> Trainer:
    return Trainer(compose_train([f"output_dir={tmp_path}", *SMALL, *extra]), progress=False)


def test_kl_reference_is_the_base_model(tmp_path) -> None:
    # B = 0: the adapter adds exact zeros, so policy and reference means are the same bytes and KL is 0
    tr = _trainer(tmp_path / "zero", "lora.init=zero_b", "train.beta=0.5")
    row = tr.train_epoch(0)
    assert row["kl_loss"] == 0.0 and row["first_update_ratio_exact_one_frac"] == 1.0
    # a live adapter: KL > 0 on the first update, and the adapter is back on (and trainable) afterwards
    tr = _trainer(tmp_path / "live", "lora.init=random", "train.beta=0.5")
    row = tr.train_epoch(0)
    assert row["kl_loss"] > 0.0 and row["first_update_ratio_exact_one_frac"] == 1.0
    assert all(p.requires_grad for _, p in tr.named)
    samples = rollout_epoch(tr.model, tr.rollout_rt, tr.prompts, tr.sigmas, tr.grid, tr.scfg, tr.seed, 1)
    pairs = tr._pairs(samples)[:3]
    with side(tr.model, tr.train_rt), torch.no_grad():
        on = tr._eval_pairs(samples, pairs).mean
        with adapters_disabled(tr.model):
            off = tr._eval_pairs(samples, pairs).mean
        again = tr._eval_pairs(samples, pairs).mean
    assert not torch.equal(on, off)
    assert_bytes_equal(again, on, "policy mean after the reference forward")


def test_sde_window_same_latent_and_inner_epochs(tmp_path) -> None:
    tr = _trainer(tmp_path, "sampler.num_steps=4", "sample.sde_window_size=2", "sample.same_latent=true",
                  "train.num_inner_epochs=2", "lora.init=random")
    samples = rollout_epoch(tr.model, tr.rollout_rt, tr.prompts, tr.sigmas, tr.grid, tr.scfg, tr.seed, 0)
    for g, start in enumerate(samples.window_starts):
        for n in (2 * g, 2 * g + 1):
            assert samples.sde_steps[n] == [start, start + 1]
            outside = [s for s in range(4) if s not in samples.sde_steps[n]]
            assert all(float(samples.logp[s, n]) == 0.0 for s in outside)
        assert_bytes_equal(samples.x[0, 2 * g], samples.x[0, 2 * g + 1], f"group {g} initial noise")
        assert not torch.equal(samples.x[-1, 2 * g], samples.x[-1, 2 * g + 1])  # different SDE noise
    row = tr.train_epoch(0)
    assert row["pairs"] == 8 and row["optimizer_updates"] == 2  # 4 samples × 2 window steps, 2 inner epochs
    assert row["first_update_ratio_exact_one_frac"] == 1.0
    assert row["ratio_exact_one_frac"] < 1.0  # the second inner epoch sees the updated policy
    assert len(row["sde_window_starts"]) == 2

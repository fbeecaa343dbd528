"""The rollout's own logp is the old policy: ratio exactly 1.0 on the first update in strict mode, not with runtime=off."""

from __future__ import annotations

import pytest
import torch

from tests.training.conftest import compose_train
from mmdit_strict.training.loop import OldLogpMismatch, Trainer
from tests.harness import assert_bytes_equal
from tests.training.conftest import SMALL


def _trainer(tmp_path, *extra: str) -> Trainer:
    return Trainer(compose_train([f"output_dir={tmp_path}", *SMALL, *extra]), progress=False)


def test_first_update_ratio_is_exactly_one_for_every_pair(tmp_path) -> None:
    # rollout: batches of 4, CFG batched; training: shuffled micro-batches of 3 pairs, CFG sequential;
    # one optimizer update covers all 12 pairs, so every pair's ratio is taken before any step
    tr = _trainer(tmp_path, "lora.init=random", "train.recompute_old_logp=true")
    rows = [tr.train_epoch(e) for e in range(2)]
    for row in rows:
        assert row["pairs"] == 12 and row["first_update_pairs"] == 12 and row["optimizer_updates"] == 1
        assert row["first_update_ratio_exact_one_frac"] == 1.0, row
        assert row["first_update_ratio_max_abs_dev"] == 0.0
        assert row["first_update_logp_bytes_differ"] == 0
        assert row["grad_fold"] == "sink"


def test_ratio_per_pair_bytes(tmp_path) -> None:
    """The same claim pair by pair: the training forward's logp equals the recorded logp bytes."""
    from mmdit_strict.kernels.runtime import runtime_mode
    from mmdit_strict.training.rollout import rollout_epoch

    tr = _trainer(tmp_path, "lora.init=random")
    samples = rollout_epoch(tr.model, tr.rollout_rt, tr.prompts, tr.sigmas, tr.grid, tr.scfg, tr.seed, 0)
    pairs = tr._pairs(samples)
    assert len(pairs) == 12
    with runtime_mode(tr.train_rt):
        for i in range(0, 12, 3):  # micro-batches of 3 with autograd on, as in training
            part = pairs[i:i + 3]
            got = tr._eval_pairs(samples, part).logp
            assert got.requires_grad
            want = torch.stack([samples.logp[s, n] for n, s in part])
            assert_bytes_equal(got.detach(), want, f"logp of pairs {part}")
            assert_bytes_equal(torch.exp(got.detach() - want), torch.ones(len(part)), "ratio")


def test_production_training_side_drifts_and_says_how_far(tmp_path) -> None:
    tr = _trainer(tmp_path / "a", "lora.init=random", "train.runtime=off")
    row = tr.train_epoch(0)
    assert row["first_update_ratio_exact_one_frac"] < 1.0
    assert 0.0 < row["first_update_ratio_max_abs_dev"] < 0.1, row["first_update_ratio_max_abs_dev"]
    # every pair whose ratio is not 1.0 has logp bytes that differ, and the byte count sees at least as many
    assert row["first_update_logp_bytes_differ"] >= round((1 - row["first_update_ratio_exact_one_frac"]) * row["first_update_pairs"]) > 0
    assert row["grad_fold"] == "autograd"  # the production backward deposits no per-sample partials
    tr = _trainer(tmp_path / "b", "lora.init=random", "train.runtime=off", "train.recompute_old_logp=true")
    with pytest.raises(OldLogpMismatch, match="recomputed logp .* != rollout logp"):
        tr.train_epoch(0)



def test_the_byte_count_sees_drift_that_a_ratio_of_one_hides() -> None:
    """|Δlogp| of 2^-24 or less leaves the FP32 ratio at exactly 1.0; the logp byte count still sees it."""
    from mmdit_strict.training.loss import grpo_loss, logp_bytes_differ

    old = torch.tensor([0.5, -3.0, 7.25])
    logp = old.clone()
    logp[0] = torch.nextafter(old[0], torch.tensor(1.0))  # 0.5 + 2^-24 ... one ulp up
    pl = grpo_loss(logp, old, torch.ones(3), 1.0 / 3, 0.2, 5.0)
    assert torch.equal(pl.ratio, torch.ones(3)), "the ratio rounds to exactly 1.0"
    assert logp_bytes_differ(logp, old).tolist() == [True, False, False]
    with pytest.raises(ValueError, match="FP32"):
        logp_bytes_differ(logp.double(), old.double())


@pytest.mark.parametrize("keep", [True, False])
def test_the_config_chooses_whether_checkpoints_keep_attention_outputs(tmp_path, keep: bool) -> None:
    """``train.keep_attention_outputs`` reaches the policy model (checkpointed strict steps keep the attention
    outputs for their recompute, or recompute them for the least memory)."""
    cfg = compose_train([f"output_dir={tmp_path}", *SMALL, "train.grad_checkpointing=true",
                         f"train.keep_attention_outputs={str(keep).lower()}"])
    tr = Trainer(cfg, progress=False)
    assert tr.model.gradient_checkpointing is True and tr.model.keep_attention_outputs is keep

"""GRPO training with edit conditioning (``prompts.edit``): each group's samples carry their prompt's input image.

The rollout, every policy forward of the updates and the evaluation pass the prompt's conditioning latents
through ``engine.velocity``; a micro-batch mixes conditioning sizes. Held to: the first update's logp is the
rollout's bytes (ratio exactly 1.0), and the conditioning bytes reach the policy forward.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmdit_strict.cli.main import main
from mmdit_strict.kernels.runtime import runtime_mode
from mmdit_strict.model.edit import ConditionImage
from mmdit_strict.trajectories.conditioning import write_latents_file
from mmdit_strict.trajectories.setup import Prompts
from mmdit_strict.training.loop import Trainer
from mmdit_strict.training.policy import evaluate_pairs
from mmdit_strict.training.rollout import rollout_epoch
from tests.training.conftest import SMALL, compose_train

# three prompts on three conditioning sizes (4×4, 2×6, 6×3 tokens): rollout batches and micro-batches mix them
EDIT = ["prompts.edit.source=seeded", "prompts.edit.sizes=[[64,64],[32,96],[96,48]]", "prompts.edit.seed=0"]
ADAPTER = Path("lora") / "peft" / "adapter_model.safetensors"
QUICK = ["--quiet", "wandb.mode=disabled", "sampler.num_steps=3", "sample.prompts_per_epoch=2", "sample.num_image_per_prompt=2",
         "train.num_epochs=1", "train.timestep_fraction=1.0", "train.micro_batch=3", "train.gradient_accumulation_steps=4", "train.eval_freq=1",
         "train.eval_num_prompts=2", "train.save_freq=1"]


def _trainer(out: Path, *extra: str) -> Trainer:
    return Trainer(compose_train([f"output_dir={out}", *SMALL, *EDIT, *extra]), progress=False)


def _grids(tr: Trainer, samples, pairs) -> set[tuple[int, int]]:
    return {tr.prompts.images[samples.prompt_ids[n]].grid for n, _ in pairs}


def test_edit_first_update_is_on_policy_with_mixed_conditioning_sizes(tmp_path: Path) -> None:
    tr = _trainer(tmp_path, "lora.init=random", "train.recompute_old_logp=true", "train.sort_update_pairs=false")
    assert tr.prompts.images is not None and [im.grid for im in tr.prompts.images] == [(4, 4), (2, 6), (6, 3)]
    for epoch in range(2):
        row = tr.train_epoch(epoch)
        assert row["pairs"] == 12 and row["first_update_pairs"] == 12 and row["optimizer_updates"] == 1
        assert row["first_update_ratio_exact_one_frac"] == 1.0, row
        assert row["first_update_ratio_max_abs_dev"] == 0.0
        assert row["first_update_logp_bytes_differ"] == 0
        assert row["grad_fold"] == "sink"
        assert len(set(tr.prompts.images[p].grid for p in row["prompt_ids"])) == 2  # two sizes in every epoch


def test_plus_conditioning_and_per_prompt_negatives_stay_on_policy(tmp_path: Path) -> None:
    """Several input images per prompt (Plus: counts 2 and 1 mixed in the micro-batches) and one negative per
    prompt (an edit checkpoint's negatives, encoded with each prompt's images): the first update's logp is
    still the rollout's bytes."""
    tr = _trainer(tmp_path, "lora.init=random", "train.recompute_old_logp=true", "prompts.edit.images_per_prompt=[2,1]",
                  "train.sort_update_pairs=false")
    assert [len(im.grids) for im in tr.prompts.images] == [2, 1, 2]
    g = torch.Generator().manual_seed(3)
    tr.prompts.negatives = [torch.randn(2 + i, tr.prompts.negative.shape[1], generator=g).to(tr.prompts.negative)
                            for i in range(len(tr.prompts.embeds))]
    row = tr.train_epoch(0)
    assert row["first_update_pairs"] == 12 and row["first_update_ratio_exact_one_frac"] == 1.0, row
    assert row["first_update_logp_bytes_differ"] == 0


def test_edit_policy_logp_bytes_pair_by_pair_and_the_conditioning_reaches_the_forward(tmp_path: Path) -> None:
    """Micro-batches mixing conditioning sizes reproduce the rollout's logp bytes; the same pairs evaluated
    with other conditioning latents (same grids, same prompts) do not."""
    tr = _trainer(tmp_path, "lora.init=random", "train.sort_update_pairs=false")  # shuffled cut: sizes mix
    samples = rollout_epoch(tr.model, tr.rollout_rt, tr.prompts, tr.sigmas, tr.grid, tr.scfg, tr.seed, 0)
    pairs = tr._pairs(samples)
    random.Random(f"pairs|{tr.seed}|0|0").shuffle(pairs)  # the first update's order, as the loop shuffles it
    batches = tr._update_batches(samples, pairs)
    assert any(len(_grids(tr, samples, b)) > 1 for b in batches), "no micro-batch mixes conditioning sizes"
    other = Prompts(tr.prompts.embeds, tr.prompts.negative,
                    [ConditionImage(im.latents + 0.25, im.grid) for im in tr.prompts.images])
    scale = tr.scfg.guidance_scale
    with runtime_mode(tr.train_rt):
        for part in batches:
            want = torch.stack([samples.logp[s, n] for n, s in part])
            got = tr._eval_pairs(samples, part).logp
            assert got.requires_grad
            assert torch.equal(got.detach(), want), f"logp of pairs {part}"
            moved = evaluate_pairs(tr.model, samples, part, other, tr.sigmas, tr.grid, scale, tr.tcfg.cfg_layout,
                                   tr.scfg.noise_level).logp.detach()
            assert not torch.equal(moved, want), f"pairs {part}: the conditioning latents did not change the logp"


def test_edit_conditioning_changes_what_is_trained(tmp_path: Path) -> None:
    """One epoch from the same prompts, noise and adapter: other conditioning latents → other rollout and LoRA bytes."""
    lora = []
    final = []
    for k, extra in enumerate([[], ["prompts.edit.seed=1"]]):
        tr = _trainer(tmp_path / f"r{k}", "lora.init=zero_b", *extra)
        samples = tr._rollout(0)
        final.append(samples.final.clone())
        tr.train_epoch(0)
        lora.append({n: p.detach().clone() for n, p in tr.named})
    assert not torch.equal(final[0], final[1])
    assert any(not torch.equal(lora[0][n], lora[1][n]) for n in lora[0])


def test_train_command_with_edit_conditioning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`mmdit-strict train experiment=grpo_edit_tiny` (cut to one short epoch): exit 0, ratio exactly 1 on the
    first update, the adapter written and moved off its zero-B start; a latents-file source gives the same run."""
    out = tmp_path / "seeded"
    assert main(["train", "experiment=grpo_edit_tiny", f"output_dir={out}", *QUICK]) == 0
    printed = capsys.readouterr().out
    assert "first-update logp byte-equal to the rollout's: 12/12 pairs (max |ratio-1| 0)" in printed, printed
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    assert rows[0]["first_update_ratio_exact_one_frac"] == 1.0 and rows[0]["first_update_logp_bytes_differ"] == 0
    assert "eval_reward_mean" in rows[0]
    adapter = load_file(str(out / ADAPTER))
    b = [v for k, v in adapter.items() if "lora_B" in k]
    assert b and any(bool(v.abs().sum() > 0) for v in b), "training left every lora_B at its zero init"

    # the same conditioning from a latents file (what `run` writes for source=folder): the same adapter bytes
    tr = Trainer(compose_train([f"output_dir={tmp_path / 'probe'}", "experiment=grpo_edit_tiny", "wandb.mode=disabled"]),
                 progress=False)
    path = write_latents_file(tmp_path / "cond.safetensors", tr.prompts.images)
    out2 = tmp_path / "file"
    assert main(["train", "experiment=grpo_edit_tiny", f"output_dir={out2}", *QUICK, "prompts.edit.source=latents",
                 f"prompts.edit.latents={path}"]) == 0
    got = load_file(str(out2 / ADAPTER))
    assert sorted(got) == sorted(adapter) and all(torch.equal(got[k], adapter[k]) for k in adapter)


def test_train_refuses_malformed_edit_conditioning(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="prompts.edit.latents=.* is not a file"):
        _trainer(tmp_path, "prompts.edit.source=latents", f"prompts.edit.latents={tmp_path / 'missing.safetensors'}")


def test_train_on_the_edit_tiny_experiment_with_the_tiny_train_group(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`mmdit-strict train experiment=edit_tiny train=tiny`: the main job's edit prompts trained as they are."""
    out = tmp_path / "edit_tiny"
    assert main(["train", "experiment=edit_tiny", "train=tiny", f"output_dir={out}", *QUICK]) == 0
    assert "first-update logp byte-equal to the rollout's: 12/12 pairs (max |ratio-1| 0)" in capsys.readouterr().out
    assert (out / ADAPTER).is_file()
    # without a train group edit_tiny names no reward: the error says what to add
    assert main(["train", "experiment=edit_tiny", f"output_dir={tmp_path / 'none'}", *QUICK]) == 2
    assert "train=tiny" in capsys.readouterr().err


def test_train_encodes_a_folder_of_input_pictures_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """prompts.edit.source=folder: the pictures are VAE-encoded (tiny VAE) into OUTPUT_DIR/conditioning.safetensors
    before training, the run trains on those latents (on-policy), and a resume re-encodes the same config."""
    import numpy as np
    from PIL import Image

    from mmdit_strict.trajectories.conditioning import read_latents_file

    pics = tmp_path / "pics"
    pics.mkdir()
    rng = np.random.default_rng(0)
    for name, (h, w) in {"a.png": (32, 48), "b.png": (48, 32)}.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(pics / name)
    out = tmp_path / "run"
    args = ["train", "experiment=grpo_edit_tiny", f"output_dir={out}", *QUICK, "train.export=false",
            "prompts.edit.source=folder", f"prompts.edit.folder={pics}", "prompts.edit.vae=tiny"]
    assert main(args) == 0
    assert "first-update logp byte-equal to the rollout's: 12/12 pairs (max |ratio-1| 0)" in capsys.readouterr().out
    grids = [im.grid for im in read_latents_file(out / "conditioning.safetensors", 64)]
    assert grids == [(2, 3), (3, 2)]
    assert main([*args, "resume=true"]) == 0  # nothing left to train: the re-encoded config is the checkpoint's

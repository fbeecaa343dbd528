"""The training bars on the GPU at Qwen-Image widths (1 block, BF16, strict runtime).

The Triton GEMM backward deposits per-sample partials into the grad sink, so the loop folds LoRA
gradients in sample-key order (``grad_fold == "sink"``) with the default streamed sink; the
kernel-level form of the claim is ``tests/kernels/test_triton_gemm_sink.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.training.conftest import compose_train
from mmdit_strict.training.loop import Trainer
from tests.harness import assert_bytes_equal
from tests.training.conftest import SMALL

pytestmark = pytest.mark.gpu

GPU = ["model.preset=qwen-image", "model.num_layers=1", "model.checkpoint=null", "model.device=cuda", "model.dtype=bfloat16",
       "sampler.height=256", "sampler.width=256", "prompts.max_tokens=40", "lora.rank=8", "lora.alpha=8.0"]


@pytest.fixture(autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


class _Recording(Trainer):
    def _step(self) -> float:
        self.grads.append({n: p.grad.clone() for n, p in self.named if p.grad is not None})
        return super()._step()


def test_first_update_ratio_is_exactly_one_on_the_gpu(tmp_path) -> None:
    tr = Trainer(compose_train([f"output_dir={tmp_path}", *SMALL, *GPU, "lora.init=random", "train.recompute_old_logp=true"]), progress=False)
    row = tr.train_epoch(0)
    assert row["first_update_pairs"] == 12 and row["first_update_ratio_exact_one_frac"] == 1.0, row
    assert row["peak_memory_reserved_mb"] >= row["peak_memory_mb"] > 0  # the allocator's peak holds the tensors'
    for kind in ("", "reserved_"):  # each phase's peak since its own reset; the epoch's is the larger one
        phases = [row[f"peak_memory_{kind}{phase}_mb"] for phase in ("rollout", "train")]
        assert min(phases) > 0 and row[f"peak_memory_{kind}mb"] == max(phases), row
    assert row["peak_memory_reserved_train_mb"] >= row["peak_memory_train_mb"]


def test_lora_grads_identical_for_micro_batches_on_the_gpu(tmp_path) -> None:
    runs = {}
    for mb, gas in ((1, 4), (2, 2), (4, 1)):
        tr = _Recording(compose_train([f"output_dir={tmp_path / str(mb)}", *SMALL, *GPU, "lora.init=random", f"train.micro_batch={mb}",
                                 f"train.gradient_accumulation_steps={gas}", "train.grad_checkpointing=true"]), progress=False)
        tr.grads = []
        row = tr.train_epoch(0)
        assert row["grad_fold"] == "sink", "the GPU backward deposited no per-sample LoRA partials"
        runs[mb] = tr.grads
    for mb in (2, 4):
        for u, (ga, gb) in enumerate(zip(runs[1], runs[mb])):
            for name in ga:
                assert_bytes_equal(gb[name], ga[name], f"micro_batch={mb} update {u} grad {name}")


@pytest.mark.parametrize("layout, fold, carry", [("sequential", False, False), ("batched", False, False),
                                                 ("batched", True, False), ("batched", True, True)])
def test_captured_training_steps_keep_the_uncaptured_bytes(tmp_path, layout: str, fold: bool, carry: bool) -> None:
    """``model.cuda_graphs`` replays the training forward + backward from graphs (``model/train_graphs.py``):
    every update's folded LoRA gradient and the adapter after the epoch are the uncaptured run's bytes. ``fold``:
    micro-batches of 2 pairs in the batched layout are one node of the fold's tree (4 keys from a multiple of 4),
    which ``train.fold_captured_batches`` folds inside the captured backward; ``carry``: a left child's node waits in
    the shared buffer for its sibling's step to add into (``train.carry_fold_nodes``)."""
    runs = {}
    extra = ["train.micro_batch=2", "train.gradient_accumulation_steps=6", "train.fold_captured_batches=true"] if fold else []
    extra += [f"train.carry_fold_nodes={str(carry).lower()}"]
    for graphs in (False, True):
        tr = _Recording(compose_train([f"output_dir={tmp_path / str(graphs)}", *SMALL, *GPU, "lora.init=random",
                                       f"model.cuda_graphs={str(graphs).lower()}", f"train.cfg_layout={layout}",
                                       "train.grad_checkpointing=true", *extra]), progress=False)
        tr.grads = []
        row = tr.train_epoch(0)
        assert row["grad_fold"] == "sink" and row["first_update_ratio_exact_one_frac"] == 1.0, row
        cache = tr.model.train_graphs
        assert (cache is not None and cache.replays > 0) == graphs, vars(cache) if cache is not None else None
        if graphs:  # the replays hand the sink flat buffers (fold: one node per micro-batch)
            assert row["grad_sink_group_tensors"] > 0, row
            assert any(i.deposits.fold is not None for i in cache._instances()) == fold
            assert any(i.deposits.accumulate is not None for i in cache._instances()) == carry
        runs[graphs] = (tr.grads, {n: p.detach().clone() for n, p in tr.named})
    (ga, pa), (gb, pb) = runs[False], runs[True]
    assert len(ga) == len(gb) > 0
    for u, (a, b) in enumerate(zip(ga, gb)):
        assert a.keys() == b.keys()
        for name in a:
            assert_bytes_equal(b[name], a[name], f"{layout}: update {u} grad {name}")
    for name in pa:
        assert_bytes_equal(pb[name], pa[name], f"{layout}: {name} after the epoch")


def test_background_checkpoints_of_a_gpu_run_equal_the_direct_ones(tmp_path) -> None:
    """``train.async_checkpoint`` copies the device's LoRA, AdamW and EMA to the host before the next epoch changes
    them in place: every checkpoint file equals the one written directly (state.json without the RNG states, which
    are the process's; AdamW's tensors compared loaded, since torch.save records each one's device)."""
    import json

    from mmdit_strict.training.loop import run_training

    common = [*SMALL, *GPU, "lora.init=random", "train.num_epochs=2", "train.save_freq=1", "train.ema=true"]
    for name, flag in (("background", "true"), ("direct", "false")):
        run_training(compose_train([f"output_dir={tmp_path / name}", *common, f"train.async_checkpoint={flag}"]),
                     progress=False)
    for epoch in range(2):
        a, b = (tmp_path / n / "checkpoints" / f"epoch_{epoch:06d}" for n in ("background", "direct"))
        assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
        for f in a.iterdir():
            if f.name == "state.json":
                sa, sb = (json.loads(p.read_text()) for p in (f, b / f.name))
                for s in (sa, sb):
                    s.pop("rng"), s["files"].pop("optimizer.pt")  # the file's hash: see below
                assert sa == sb, epoch
            elif f.name != "optimizer.pt":  # torch.save records where each tensor lived: host copy vs device
                assert f.read_bytes() == (b / f.name).read_bytes(), (epoch, f.name)
        oa, ob = (torch.load(p / "optimizer.pt", map_location="cpu", weights_only=True) for p in (a, b))
        for i, st in ob["optimizer"]["state"].items():
            for key, value in st.items():
                assert_bytes_equal(oa["optimizer"]["state"][i][key], value, f"epoch {epoch} AdamW {key} of param {i}")

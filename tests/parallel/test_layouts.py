"""Model-parallel layouts on a real gloo group (CPU processes): the forward and the LoRA gradients of every
layout equal one rank's, byte for byte, with prompt padding and an image length the ranks do not divide.

Each rank first computes the one-rank reference itself (no layout bound), then the same batch under the
layout; the test process compares the raw bytes.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from mmdit_strict.distributed.fold import fold_ranks
from mmdit_strict.parallel import ModelLayout, packed_rows, row_shards
from tests.harness import assert_bytes_equal

GRID = (3, 5)  # 15 image rows per sample: split 7/8 over 2 ranks, 3/4/4/4 over 4
TXT = [5, 9, 3]  # valid prompt lengths, padded to 11


def _model(heads: int = 4):
    from mmdit_strict.config.arch import preset
    from mmdit_strict.config.schema import LoraConfig
    from mmdit_strict.model.init import build_model
    from mmdit_strict.trajectories.setup import attach_lora

    arch = dataclasses.replace(preset("tiny"), num_attention_heads=heads, attention_head_dim=16,
                               axes_dims_rope=(4, 4, 8))  # tp · sp up to the head count
    model = build_model(arch, seed=3, runtime="strict")
    attach_lora(model, LoraConfig(rank=2, alpha=2.0, targets=["to_q", "to_v", "add_k_proj", "to_out.0", "img_mlp.net.2",
                                                               "txt_mlp.net.0.proj", "img_mod.1"], init="random"))
    model.requires_grad_(False)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.requires_grad_(True)
    model.gradient_checkpointing = True
    return model


def _batch():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(len(TXT), GRID[0] * GRID[1], 64, generator=g)
    cond = [torch.randn(n, 48, generator=g) for n in TXT]
    neg = torch.randn(4, 48, generator=g)
    return x, cond, neg


def _run(model, weight: torch.Tensor):
    """The CFG velocity of one batch (prompts padded to 11 tokens) + backward of a fixed linear loss; returns
    v, every LoRA gradient and the sink's tree folds."""
    from mmdit_strict.kernels.grad_sink import SampleGradSink, collect_sample_grads
    from mmdit_strict.trajectories.engine import velocity

    x, cond, neg = _batch()
    model.zero_grad(set_to_none=True)
    sink = SampleGradSink()
    with collect_sample_grads(sink):
        v = velocity(model, x, cond, neg, [0.9, 0.55, 0.3], GRID, cfg_scale=4.0, cfg_layout="sequential", pad_to=11)
        (v * weight).sum().backward()
    from mmdit_strict.distributed.fold import rank_partials

    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = {n: p.grad.clone() for n, p in trainable if p.grad is not None}
    folds = {n: sink.fold(p) for n, p in trainable}
    with torch.no_grad():
        v_nograd = velocity(model, x, cond, neg, [0.9, 0.55, 0.3], GRID, cfg_scale=4.0, cfg_layout="batched", pad_to=11)
    return {"v": v.detach(), "v_nograd": v_nograd, "grads": grads, "folds": {n: f for n, f in folds.items() if f is not None},
            "share": rank_partials(trainable, sink)}


def _edit_forward(model) -> torch.Tensor:
    """One Qwen-Image-Edit batch whose samples' conditioning images differ in size (15, 6 and 24 rows after
    15 noisy rows: image padding), no autograd."""
    from mmdit_strict.model.edit import ConditionImage, edit_batch

    g = torch.Generator().manual_seed(21)
    images = [ConditionImage(torch.randn(h * w, 64, generator=g), (h, w)) for h, w in ((3, 5), (2, 3), (4, 6))]
    batch = edit_batch(torch.randn(3, GRID[0] * GRID[1], 64, generator=g), images, GRID)
    ehs = torch.randn(3, 11, 48, generator=g)
    mask = torch.zeros(3, 11, dtype=torch.long)
    for b, n in enumerate(TXT):
        mask[b, :n] = 1
    with torch.no_grad():
        out = model(batch.hidden_states, ehs, mask, torch.tensor([0.9, 0.55, 0.3]), batch.img_shapes, return_dict=False,
                    image_padding=batch.image_padding)[0]
    return batch.velocity(out)


def _rank(rank: int, world: int, port: int, out: str, layouts: dict | None = None, heads: int = 4) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from mmdit_strict import distributed, parallel
    from mmdit_strict.parallel import groups as built

    model = _model(heads)
    weight = torch.randn(3, GRID[0] * GRID[1], 64, generator=torch.Generator().manual_seed(5))
    results = {}
    with distributed.session(120.0):
        results["one rank"] = _run(model, weight)
        results["one rank"]["edit"] = _edit_forward(model)
        for name, layout in (layouts or LAYOUTS).items():
            with parallel.model_parallel(ModelLayout(**layout)) as mpar:
                results[name] = _run(model, weight)
                results[name]["edit"] = _edit_forward(model)
                results[name]["exchanges"] = mpar.stats["calls"]
        made = list(built._BUILT.values())
    # the session ended: the subgroups it built are destroyed and forgotten, not left to interpreter exit
    results["released"] = bool(made) and not built._BUILT and all(
        m.tp_group is None and m.sp_group is None and m.cfg_group is None for m in made)
    torch.save(results, Path(out) / f"{rank}.pt")


LAYOUTS = {"sp2": {"sp": 2}, "sp4": {"sp": 4}, "cfg2": {"cfg": 2}, "sp2xcfg2": {"sp": 2, "cfg": 2}, "tp2": {"tp": 2},
           "tp4": {"tp": 4}, "tp2xsp2": {"tp": 2, "sp": 2}, "tp2xcfg2": {"tp": 2, "cfg": 2},
           "sp2ag": {"sp": 2, "attention": "allgather"}, "sp4ag": {"sp": 4, "attention": "allgather"},
           "tp2xsp2ag": {"tp": 2, "sp": 2, "attention": "allgather"}}
WIDE = {"tp2xsp2xcfg2": {"tp": 2, "sp": 2, "cfg": 2}, "tp4xsp2": {"tp": 4, "sp": 2}}  # 8 ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(tmp_path: Path, world: int, layouts: dict) -> None:
    for r in range(world):
        res = torch.load(tmp_path / f"{r}.pt")
        assert res["released"] is True, f"rank {r}: subgroups outlived their session"
        ref = res["one rank"]
        assert len(ref["grads"]) > 0 and len(ref["folds"]) > 0
        for name in layouts:
            got = res[name]
            what = f"rank {r} {name}"
            assert_bytes_equal(got["v"], ref["v"], f"{what}: v (autograd)")
            assert_bytes_equal(got["v_nograd"], ref["v"], f"{what}: v (no grad, batched CFG)")
            assert_bytes_equal(got["edit"], ref["edit"], f"{what}: edit batch with mixed conditioning sizes")
            if layouts[name].get("cfg", 1) == 1:  # every rank of the group ran both branches: its own sums are one rank's
                assert sorted(got["grads"]) == sorted(ref["grads"]), what
                for p in ref["grads"]:
                    assert_bytes_equal(got["grads"][p], ref["grads"][p], f"{what}: grad {p}")
            # the group's gradient: the per-sample partials of each branch's first (sequence 0, tensor 0) rank,
            # folded over the sample keys
            lay = ModelLayout(**layouts[name])
            members = [q for q in lay.group_ranks(world, "model")[lay.coords(r)["dp"]]
                       if lay.coords(q)["sp"] == 0 and lay.coords(q)["tp"] == 0]
            shares = [torch.load(tmp_path / f"{q}.pt")[name]["share"] for q in members]
            for p in ref["folds"]:
                assert_bytes_equal(fold_ranks(p, shares), ref["folds"][p], f"{what}: group fold {p}")
            assert got["exchanges"] > 0, f"{what} exchanged nothing"


def test_every_layout_gives_one_rank_velocity_and_lora_grads(tmp_path: Path) -> None:
    world = 4
    mp.spawn(_rank, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    _check(tmp_path, world, LAYOUTS)


@pytest.mark.slow
@pytest.mark.extended  # every axis and pair of axes is in the 4-rank test above; 8 processes take ~30 s on 2 cores
def test_eight_rank_layouts_give_one_rank_bytes(tmp_path: Path) -> None:
    """TP2 x SP2 x CFG2 and TP4 x SP2 (8 heads): every parallel axis at once."""
    world = 8
    mp.spawn(_rank, args=(world, _free_port(), str(tmp_path), WIDE, 8), nprocs=world, join=True)
    _check(tmp_path, world, WIDE)


def test_row_shards_cover_each_sample_in_order_without_padding() -> None:
    shards = row_shards([15, 6889], 4)
    assert [s[0] for s in shards] == [(0, 3), (3, 7), (7, 11), (11, 15)]
    assert [b - a for a, b in (s[1] for s in shards)] == [1722, 1722, 1722, 1723]
    rows = [packed_rows([15, 6889], 4, k) for k in range(4)]
    assert sorted(i for r in rows for i in r) == list(range(15 + 6889))
    with pytest.raises(ValueError, match="cannot be split"):
        row_shards([3], 4)


def test_layout_coordinates_and_groups() -> None:
    lay = ModelLayout(sp=2, cfg=2)
    assert lay.size == 4 and lay.groups(8) == 2
    assert lay.coords(5) == {"dp": 1, "cfg": 0, "sp": 1, "tp": 0}
    assert lay.group_ranks(8, "sp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.group_ranks(8, "cfg") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.leader(7) == 4
    with pytest.raises(ValueError, match="multiple of 4"):
        lay.check(6)
    with pytest.raises(ValueError, match="divide the head count"):
        ModelLayout(sp=4).check(4, heads=6)
    tp = ModelLayout(tp=2, sp=2)
    assert tp.coords(3) == {"dp": 0, "cfg": 0, "sp": 1, "tp": 1}
    assert tp.group_ranks(8, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert tp.group_ranks(8, "sp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(ValueError, match="tp must divide the head count"):
        ModelLayout(tp=4).check(4, heads=6)
    with pytest.raises(ValueError, match="divided by tp"):
        ModelLayout(tp=2, sp=2).check(4, heads=6)
    with pytest.raises(ValueError, match="cfg must be 1 or 2"):
        ModelLayout(cfg=3)


def test_the_owner_of_a_drifting_row_is_named_by_shard_and_branch() -> None:
    from mmdit_strict.parallel.layout import row_owner

    lay = ModelLayout(sp=2, cfg=2)  # group of ranks 4..7: cfg 0 = ranks 4, 5; cfg 1 = ranks 6, 7
    assert row_owner(lay, 4, "cond", "noisy latent", 6, 15) == "rank 4 (sp 0 of 2, cfg 0)"
    assert row_owner(lay, 4, "cond", "conditioning image", 7, 15) == "rank 5 (sp 1 of 2, cfg 0)"  # rows 7.. are shard 1
    assert row_owner(lay, 4, "neg", "noisy latent", 14, 15) == "rank 7 (sp 1 of 2, cfg 1)"
    assert row_owner(lay, 4, "neg", "text", 3, 15) == "rank 6 (replicated on the 2 sequence ranks, cfg 1)"
    assert row_owner(ModelLayout(), 2, "cond", "noisy latent", 3, 15) == "rank 2"
    tp = ModelLayout(tp=2, sp=2)  # ranks 0..3: (sp 0: tp 0, 1), (sp 1: tp 0, 1)
    assert row_owner(tp, 0, "cond", "noisy latent", 9, 15, "mlp_up_gemm_gelu", 70, 128) == "rank 3 (tp 1 of 2, sp 1 of 2)"
    assert row_owner(tp, 0, "cond", "text", 2, 15, "qkv_bias_gemm", 5, 32) == \
        "rank 0 (tp 0 of 2, replicated on the 2 sequence ranks)"
    assert row_owner(tp, 0, "cond", "noisy latent", 1, 15, "adaln_modulation", 31, 32) == \
        "rank 0 (replicated on the 2 tensor ranks, sp 0 of 2)"

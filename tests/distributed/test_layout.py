"""The split rule and the cross-rank gradient fold, without processes."""

from __future__ import annotations

import random

import pytest
import torch

from mmdit_strict.distributed import SidePlan, agree, current, finish, from_root, gather_to_root, launched, stage
from mmdit_strict.distributed.agree import differences, flatten
from mmdit_strict.distributed.fold import fold_ranks
from mmdit_strict.distributed.layout import block, cut, owners, rank_batches
from mmdit_strict.kernels.grad_sink import SampleGradSink


def test_blocks_cover_the_order_once_in_order() -> None:
    for n in range(0, 9):
        for world in range(1, 6):
            spans = [block(n, world, r) for r in range(world)]
            assert [i for s in spans for i in s] == list(range(n))
            assert max(len(s) for s in spans) - min(len(s) for s in spans) <= 1


def test_rank_batches_of_one_rank_are_the_single_process_batches() -> None:
    order = [3, 0, 2, 1, 5, 4]
    assert rank_batches(order, 4, 1, 0) == cut(order, 4) == [[3, 0, 2, 1], [5, 4]]
    assert rank_batches(order, 4, 2, 0) == [[3, 0, 2]] and rank_batches(order, 4, 2, 1) == [[1, 5, 4]]
    assert owners(order, 2) == {3: 0, 0: 0, 2: 0, 1: 1, 5: 1, 4: 1}
    assert rank_batches([0, 1], 3, 4, 0) == [] and rank_batches([0, 1], 3, 4, 3) == [[1]]
    with pytest.raises(ValueError):
        cut(order, 0)


def test_single_process_plan_moves_nothing() -> None:
    assert not launched() or current() is None
    plan = SidePlan([2, 0, 1], 2)
    assert plan.batches == [[2, 0], [1]] and plan.root and not plan.distributed
    assert plan.end_step(None, 0) is None and plan.side_fields([0, 1, 2]) == {}
    calls: list[str] = []
    assert plan.resume(None, lambda: calls.append("load"), lambda: calls.append("begin")) is None
    assert calls == ["load", "begin"]
    with stage("x"):
        pass
    assert from_root("x", lambda: 7) == 7 and gather_to_root("x", 5) == [5] and finish(1) == 1
    agree("anything", {"a": 1})


def test_fold_across_ranks_is_the_single_process_fold() -> None:
    g = torch.Generator().manual_seed(0)
    keys = [(s, b) for s in range(7) for b in (0, 1)]
    parts = {k: torch.randn(5, 3, generator=g) * 10 ** torch.randint(-3, 4, (1,), generator=g).item() for k in keys}
    param = torch.empty(5, 3)
    single = SampleGradSink()
    shuffled = list(keys)
    random.Random(1).shuffle(shuffled)
    single.add(param, shuffled, [parts[k] for k in shuffled])
    want = single.fold(param)
    for world in (1, 2, 3, 4):
        shares = [{"with_grad": ["w"], "partials": {"w": {}}} for _ in range(world)]
        for i, k in enumerate(shuffled):
            owner = next(r for r in range(world) if i in block(len(shuffled), world, r))
            shares[owner]["partials"]["w"][k] = parts[k]
        got = fold_ranks("w", shares)
        assert got is not None and torch.equal(got.view(torch.int32), want.view(torch.int32))
    dup = [{"with_grad": ["w"], "partials": {"w": {keys[0]: parts[keys[0]]}}}] * 2
    with pytest.raises(ValueError, match="ran twice"):
        fold_ranks("w", dup)


def test_config_differences_name_the_key() -> None:
    a = flatten({"sampler": {"num_steps": 2, "eta": 0.7}, "extra": {}})
    b = flatten({"sampler": {"num_steps": 3, "eta": 0.7}, "extra": {}})
    assert a == {"sampler.num_steps": 2, "sampler.eta": 0.7, "extra": {}}
    assert differences(b, a) == ["sampler.num_steps"]

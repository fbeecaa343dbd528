"""CUDA-graph replay of the strict forward (``model/graphs.py``): same bytes as eager, one graph per layout."""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.config.arch import preset
from mmdit_strict.kernels.trace import capture_trace
from mmdit_strict.model.init import build_model
from mmdit_strict.model.inputs import random_inputs
from tests.helpers import strict_qwen_image_cuda


def _on(inp: dict, device: str, dtype: torch.dtype) -> dict:
    return {k: (v.to(device=device, dtype=dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                else v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}


def test_keepalive_collects_only_inside_retaining() -> None:
    from mmdit_strict.kernels.keepalive import retain, retaining
    from mmdit_strict.model.rope import packed_rope_tables

    assert retain("x") == "x"
    with retaining() as held:
        tables = packed_rope_tables([[(1, 2, 3)]], [4], (4, 6, 6), 10000.0, "cpu")
    assert len(held) == 1 and held[0] is tables
    packed_rope_tables([[(1, 2, 3)]], [4], (4, 6, 6), 10000.0, "cpu")
    assert len(held) == 1


def test_graphs_are_bypassed_on_the_cpu_and_with_autograd() -> None:
    arch = preset("tiny")
    model = build_model(arch, seed=0, runtime="strict").enable_cuda_graphs()
    inp = random_inputs(arch, (4, 4), [5, 3])
    with torch.no_grad():
        out = model(**inp).sample
    assert model.graph_cache.captures == 0 and model.graph_cache.replays == 0
    model.enable_cuda_graphs(False)
    with torch.no_grad():
        assert torch.equal(out, model(**inp).sample)


@pytest.mark.gpu
def test_graph_replay_equals_eager_strict_forward_bytes() -> None:
    arch, model = strict_qwen_image_cuda(num_layers=2)
    layouts = [random_inputs(arch, (16, 16), [77, 20], seed=1), random_inputs(arch, (16, 16), [77, 20], seed=2),
               random_inputs(arch, (8, 24), [5], seed=3)]
    layouts = [_on(i, "cuda", torch.bfloat16) for i in layouts]
    with torch.no_grad():
        eager = [model(**i).sample for i in layouts]
        model.enable_cuda_graphs()
        with capture_trace() as trace:
            graphed = [model(**i).sample for i in layouts]
            again = model(**layouts[0]).sample
    assert model.graph_cache.captures == 2  # two layouts; the second input of layout 1 replays its graph
    assert model.graph_cache.replays == 4
    # one memory pool for both layouts' graphs, and layout 0 replayed after layout 1 (not in capture order) above
    assert len({c.graph.pool() for c in model.graph_cache._graphs.values()}) == 1
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)
    assert torch.equal(eager[0], again)
    # every per-layout table cache dropped: the graphs keep what they read alive and still replay the same bytes
    from mmdit_strict.kernels.triton import attention, segments
    from mmdit_strict.kernels.triton.gemm import launch as gemm_launch
    from mmdit_strict.model import rope

    gemm_launch._STARTS.clear(), segments.TABLES.clear(), attention._TABLES.clear(), rope._packed_tables.cache_clear()
    torch.cuda.empty_cache()
    scribble = [torch.full((1 << 20,), -7, dtype=torch.int32, device="cuda") for _ in range(16)]
    with torch.no_grad():
        assert torch.equal(eager[1], model(**layouts[1]).sample)
    del scribble
    assert not trace.fallbacks
    calls = {r.op: r.calls for r in trace.records.values()}
    # 4 per block (img/txt × attention/MLP) per forward, 4 forwards: capture-time calls count once per call
    assert calls["adaln_gate_residual"] == 4 * arch.num_layers * 4

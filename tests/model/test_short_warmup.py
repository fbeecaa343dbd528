"""A capture warmed up on the first and last blocks only (``graphs.SHORT_WARMUP``) must find every per-layout table
and launch plan the whole step needs already built: during a CUDA-graph capture a table copied from the host cannot
be captured and a new kernel specialization would compile mid-capture.

Checked on the CPU by running the strict model's Triton kernels under the interpreter (the Triton implementations
registered for the CPU for the test): after a training warm-up of blocks 0 and n-1 (forward with checkpointing,
backward into a capture's deposit log), the full step of the same layout adds nothing to any table cache or
launch-plan cache and launches no kernel the warm-up did not; a forward of another layout adds entries (the check can
see a miss). Kernel specializations (compiles) exist on the GPU only: ``tests/model/test_train_graphs.py``'s
``test_a_short_warmup_captures_the_same_steps`` captures after a short warm-up there.
"""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.kernels import registry
from mmdit_strict.kernels.cpu import primitives
from mmdit_strict.kernels.execution import bind, current
from mmdit_strict.kernels.deposit_log import DepositLog
from mmdit_strict.kernels.runtime import Runtime
from mmdit_strict.kernels.triton import attention, bound, segments
from mmdit_strict.kernels.triton.gemm import launch
from mmdit_strict.model import graphs, rope
from mmdit_strict.model.strict import strict_forward
from tests.helpers import make_inputs
from tests.kernels.triton_rows import interp
from tests.model.triton_cpu import tiny_lora_model, triton_on_the_cpu


def _built() -> dict[str, int]:
    """How much every per-layout cache has built so far (entries, or misses for the LRU caches)."""
    return {
        "gemm row offsets": len(launch._STARTS), "gemm plans": len(launch._PLANS),
        "gemm sample spans": len(launch._SAMPLE_SPANS), "gemm row samples": len(launch._SAMPLES),
        "kernels launched": len(bound._BOUND),  # (specializations of each are the GPU test's to check)
        "attention tiles": len(attention._TABLES), "row chunks": len(segments.TABLES._entries),
        "rope image angles": rope._image_angles.cache_info().misses, "rope text angles": rope._text_angles.cache_info().misses,
        "rope packed": rope._packed_tables.cache_info().misses,
        "row sample index": primitives._row_sample_index.cache_info().misses,
    }


@interp
@pytest.mark.slow  # ~35 s on 2 cores: every launch of a 3-block LoRA step, forward and backward, through the interpreter
def test_a_two_block_warmup_builds_what_the_whole_step_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    triton_on_the_cpu(monkeypatch)
    monkeypatch.setattr(graphs, "SHORT_WARMUP", True)
    arch, model, params = tiny_lora_model(3)

    def step(txt_lens: list[int], blocks) -> None:
        raw = make_inputs(2, (4, 4), txt_lens, txt_dim=arch.joint_attention_dim, seed=1)
        raw.pop("guidance", None)
        inputs = model.validate_inputs(**raw)
        # as the model's forward and a capture's warm-up bind them
        with bind(current().replace(runtime=Runtime.STRICT, grad_sink=DepositLog(), sample_keys=(0, 1))):
            out = strict_forward(model, inputs, blocks=blocks)
            torch.autograd.grad(out, params, torch.ones_like(out), allow_unused=True)

    warm = model._graph_warmup()
    assert warm is not None and graphs.warmup_blocks(3) == (0, 2)
    step([11, 6], (0, 2))  # prompt lengths no other test uses: this layout's tables are built here
    built = _built()
    step([11, 6], None)
    assert _built() == built, "the whole step built what the two-block warm-up did not"
    assert {k[0]: v[0].backend for k, v in registry._DISPATCH.items()}["qkv_bias_gemm"] == "triton"
    step([10, 6], (0,))
    grew = [k for k, v in _built().items() if v > built[k]]
    assert {"gemm row offsets", "attention tiles", "rope packed"} <= set(grew), grew  # another layout: the check sees misses


@interp
@pytest.mark.parametrize("fold", [False, True])
def test_a_captured_steps_deposits_land_in_the_arena_with_the_sinks_bytes(monkeypatch: pytest.MonkeyPatch, fold: bool) -> None:
    """A 1-block LoRA step through the Triton kernels (interpreter) into what a captured step binds — a deposit log
    without autograd sums whose buffers are a :class:`PartialArena` reserved for every trained tensor — folds to the
    bytes of the same step straight into a sink that lets autograd sum too; every partial lands in the arena and no
    ``.grad`` is written. ``fold``: the log folds the two samples (one node of the sink's tree) into one buffer per
    tensor, from the kernels' fresh per-sample partials."""
    from mmdit_strict.kernels.grad_sink import SampleGradSink
    from mmdit_strict.model.train_graphs import PartialArena

    triton_on_the_cpu(monkeypatch)
    arch, model, params = tiny_lora_model(1)
    raw = make_inputs(2, (4, 4), [9, 4], txt_dim=arch.joint_attention_dim, seed=2)
    raw.pop("guidance", None)
    inputs = model.validate_inputs(**raw)
    keys = [("s", 1), ("s", 0)]

    def step(sink, sample_keys) -> None:
        with bind(current().replace(runtime=Runtime.STRICT, grad_sink=sink, sample_keys=sample_keys)):
            out = strict_forward(model, inputs)
        (out * out).sum().backward()

    plain = SampleGradSink(keys)
    step(plain, tuple(keys))
    trained = {id(p) for p in params if p.grad is not None}  # the last block's text stream has no path to the output
    assert 0 < len(trained) < len(params)
    plain.done(keys)
    want = {id(p): plain.fold(p) for p in params}
    for p in params:
        p.grad = None
    arena = PartialArena()
    log = DepositLog(autograd_sums=False, fold=plain.node_order(keys) if fold else None)
    assert not fold or log.fold == (1, 0)
    arena.attach(log, params, 2)
    step(log, (0, 1))
    assert all(p.grad is None for p in params), "a deposit log without sums had autograd write .grad"
    positions = (0,) if fold else (0, 1)
    in_arena = {arena.buffer(p, pos, 0).data_ptr() for p in params for pos in positions}
    landed = [t.data_ptr() for _, _, parts in log.entries for t in parts]
    assert landed and set(landed) <= in_arena and len(landed) == len(set(landed))
    sink = SampleGradSink(keys, autograd_sums=False)
    log.replay(sink, keys)
    sink.done(keys)
    assert len(landed) == len(positions) * len(trained)  # one partial (folded: one node) per trained tensor and sample
    assert sink.stats.group_tensors == len(trained)  # taken from the flat buffers as one group
    for i, p in enumerate(params):
        got = sink.fold(p)
        if want[id(p)] is None:
            assert got is None and id(p) not in trained
            continue
        assert torch.equal(got, want[id(p)]), f"LoRA tensor {i} ({tuple(p.shape)})"

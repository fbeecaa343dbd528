"""The strict model on the GPU at Qwen-Image widths (2 blocks, BF16): invariance, fusion and trace.

* a sample alone gives the bytes it gets inside a batch of 3 at any position, with other prompt lengths
  and prompt padding beside it;
* the fused QK-norm + RoPE path (normal runs) gives the bytes of the unfused pair (operator capture
  forces the unfused path);
* ``strict`` records zero fallbacks.
"""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.kernels.trace import capture_trace
from mmdit_strict.model.inputs import random_inputs
from mmdit_strict.model.strict import capture_operators
from tests.helpers import strict_qwen_image_cuda

pytestmark = pytest.mark.gpu
GRID = (12, 20)


@pytest.fixture(scope="module")
def model():
    return strict_qwen_image_cuda(num_layers=2)[1]


def _cuda(inp: dict) -> dict:
    out = {}
    for k, v in inp.items():
        if isinstance(v, torch.Tensor):
            v = v.cuda()
            out[k] = v.to(torch.bfloat16) if v.is_floating_point() else v
        else:
            out[k] = v
    return out


def _sample(inp: dict, b: int) -> dict:
    n = int(inp["encoder_hidden_states_mask"][b].sum())
    return {"hidden_states": inp["hidden_states"][b:b + 1], "encoder_hidden_states": inp["encoder_hidden_states"][b:b + 1, :n],
            "encoder_hidden_states_mask": inp["encoder_hidden_states_mask"][b:b + 1, :n], "timestep": inp["timestep"][b:b + 1],
            "img_shapes": inp["img_shapes"][:1]}


def test_sample_alone_equals_batched_with_padding(model) -> None:
    batch = _cuda(random_inputs(model.config, GRID, [77, 5, 130], pad_to=160, seed=4))
    with torch.no_grad(), capture_trace() as trace:
        together = model(**batch).sample
        for b in range(3):
            alone = model(**_sample(batch, b)).sample
            assert torch.equal(alone[0], together[b]), f"sample {b}"
    assert not trace.fallbacks


def test_fused_qk_norm_rope_equals_unfused_pair(model) -> None:
    inp = _cuda(random_inputs(model.config, GRID, [33, 9], seed=5))
    with torch.no_grad():
        fused = model(**inp).sample
        with capture_operators() as cap:
            unfused = model(**inp).sample
    assert any(k.endswith("multi_axis_rope") for k in cap)  # the capture run took the unfused pair
    assert torch.equal(fused, unfused)

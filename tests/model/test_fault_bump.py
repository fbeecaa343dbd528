"""A planted fault changes the bytes of its operator's output in every execution dtype (issue 32: in BF16 a
2⁻¹⁰ relative bump rounded away, and the planted probe of the GPU ablation was never caught)."""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.model.strict import _bump


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("value", [0.3, 1.0, 1.9921875, -7.5, 300.0])
def test_the_bump_survives_rounding(dtype: torch.dtype, value: float) -> None:
    out = torch.full((2, 3), value, dtype=dtype)
    bumped = _bump(out)
    assert bumped.dtype == dtype
    assert not torch.equal(bumped.view(-1)[:1].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           out.view(-1)[:1].view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert torch.equal(bumped.view(-1)[1:], out.view(-1)[1:])  # only the first element moves

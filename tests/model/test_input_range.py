"""The model refuses sigmas outside [0, 1] and an empty batch with a clear ValueError."""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.config.arch import preset
from mmdit_strict.model import build_model
from tests.helpers import make_inputs


@pytest.fixture(scope="module")
def model():
    return build_model(preset("tiny"), seed=0)


def test_timestep_outside_sigma_range_is_refused(model) -> None:
    inputs = make_inputs(2, (2, 2), [3, 4])
    inputs["timestep"] = torch.tensor([500.0, 0.5])
    with pytest.raises(ValueError, match=r"timestep must be sigmas in \[0, 1\]"):
        model(**inputs)
    inputs["timestep"] = torch.tensor([-0.1, 0.5])
    with pytest.raises(ValueError, match=r"timestep must be sigmas in \[0, 1\]"):
        model(**inputs)


def test_empty_batch_is_refused(model) -> None:
    inputs = make_inputs(1, (2, 2), [3])
    inputs = {k: (v[:0] if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    inputs["img_shapes"] = []
    with pytest.raises(ValueError, match="at least one sample"):
        model(**inputs)

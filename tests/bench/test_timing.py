"""The benches' shared timing helpers, on the CPU: the median's two result forms and the no-graph answer."""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.bench.timing import graph_ms, median_ms


def test_median_ms_reads_a_float_or_a_one_element_list() -> None:
    assert median_ms(0.5) == 0.5
    assert median_ms([0.25]) == 0.25
    assert median_ms((2,)) == 2.0 and isinstance(median_ms((2,)), float)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-capture answer needs a machine without CUDA")
def test_graph_ms_is_none_where_no_graph_can_be_captured() -> None:
    pytest.importorskip("triton")
    calls = []
    assert graph_ms(lambda: calls.append(1), rep=5) is None
    assert calls == [1]  # the warm call ran once, outside any capture

"""The benches' shared timing helpers, on the CPU: the median's two result forms, the no-graph answer and the
profiler that tears CUPTI down."""

from __future__ import annotations

import os

import pytest
import torch

from mmdit_strict.bench.timing import cuda_profiler, graph_ms, median_ms


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


def test_cuda_profiler_asks_kineto_to_tear_cupti_down_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    with cuda_profiler(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(3).sum()
    assert isinstance(prof, profile)
    assert any(e.name == "aten::sum" for e in prof.events())  # a working profiler, not a stand-in
    assert os.environ["TEARDOWN_CUPTI"] == "1"
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")  # the user's choice stands
    cuda_profiler(activities=[ProfilerActivity.CPU])
    assert os.environ["TEARDOWN_CUPTI"] == "0"
    monkeypatch.delenv("TEARDOWN_CUPTI")  # a process that times nothing after its profiles keeps CUPTI up
    cuda_profiler(False, activities=[ProfilerActivity.CPU])
    assert os.environ["TEARDOWN_CUPTI"] == "0"
    monkeypatch.setenv("TEARDOWN_CUPTI", "1")
    cuda_profiler(False, activities=[ProfilerActivity.CPU])
    assert os.environ["TEARDOWN_CUPTI"] == "1"


@pytest.mark.gpu
def test_host_us_counts_every_call_and_times_only_the_loop() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from mmdit_strict.bench.timing import host_us

    calls: list[int] = []
    x = torch.ones(8, device="cuda")
    us = host_us(lambda: calls.append(1) or x.add_(1), calls=200, warmup=7)
    assert len(calls) == 207 and float(x[0]) == 208.0
    assert 0.0 < us < 1e5  # a host launch of a tiny add: microseconds, not a synchronised wait

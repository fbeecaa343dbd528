"""Joint attention over query-row subsets (the kernel side of ``parallel.attention=allgather``): a rank's image
query rows against the whole samples' keys give exactly the rows the whole call gives — on the CPU strict backend
and the Triton kernel (interpreter here, FP32; the H200 layout check covers BF16)."""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.kernels.cpu import attention as C

triton = pytest.importorskip("triton")
from mmdit_strict.kernels.triton import attention as A  # noqa: E402

TSEQ, ISEQ = (5, 3), (13, 9)  # two samples; no length divides the 16-row tiles
SUBSETS = [((0, 6), (0, 4)), ((6, 13), (4, 9)), ((3, 11), (2, 7))]  # [start, stop) of each sample's image rows


def _inputs(device: str):
    g = torch.Generator().manual_seed(7)
    make = lambda n: torch.randn(n, 2, 16, generator=g).to(device)  # noqa: E731
    return [make(sum(TSEQ)) for _ in range(3)] + [make(sum(ISEQ)) for _ in range(3)]


def _check(fn, device: str) -> None:
    qt, kt, vt, qi, ki, vi = _inputs(device)
    whole_t, whole_i = fn(qt, kt, vt, qi, ki, vi, txt_seqlens=TSEQ, img_seqlens=ISEQ)
    for spans in SUBSETS:
        rows = [s0 + r for s0, (a, b) in zip((0, ISEQ[0]), spans) for r in range(a, b)]
        idx = torch.tensor(rows, device=device)
        ot, oi = fn(qt, kt, vt, qi.index_select(0, idx).contiguous(), ki, vi, txt_seqlens=TSEQ, img_seqlens=ISEQ,
                    query_img_seqlens=tuple(b - a for a, b in spans))
        assert torch.equal(ot, whole_t), spans
        assert torch.equal(oi, whole_i.index_select(0, idx)), spans


def test_cpu_strict_query_subsets_give_the_whole_calls_rows() -> None:
    _check(C.joint_attention_fused, "cpu")


@pytest.mark.skipif(not A.interpreting(), reason="interpreter (CPU FP32) test; the GPU layout check covers CUDA")
def test_triton_query_subsets_give_the_whole_calls_rows() -> None:
    _check(A.joint_attention_fused, "cpu")


@pytest.mark.skipif(not A.interpreting(), reason="interpreter (CPU FP32) test")
def test_triton_query_subsets_refuse_autograd_and_bad_counts() -> None:
    qt, kt, vt, qi, ki, vi = _inputs("cpu")
    with pytest.raises(ValueError, match="forward only"):
        A.joint_attention_fused(qt, kt, vt, qi[:10].clone().requires_grad_(), ki, vi, txt_seqlens=TSEQ, img_seqlens=ISEQ,
                                query_img_seqlens=(6, 4))
    with pytest.raises(ValueError, match="at most its image rows"):
        A.joint_attention_fused(qt, kt, vt, qi[:15].contiguous(), ki, vi, txt_seqlens=TSEQ, img_seqlens=ISEQ,
                                query_img_seqlens=(14, 1))
    with pytest.raises(ValueError, match="query_img_seqlens sums to"):
        A.joint_attention_fused(qt, kt, vt, qi[:10].contiguous(), ki, vi, txt_seqlens=TSEQ, img_seqlens=ISEQ,
                                query_img_seqlens=(6, 5))

"""The copy-bandwidth reference: the SM copy moves the bytes exactly (interpreter on the CPU, compiled on a GPU),
refuses mismatched tensors, and the reference is the faster of the two copies."""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.bench.bandwidth import SM_COPY_BLOCK, CopyReference, copy_reference, sm_copy

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter runs FP32 (not BF16); on a GPU both
DTYPES = (torch.float32, torch.bfloat16) if DEV == "cuda" else (torch.float32,)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 37, SM_COPY_BLOCK, 2 * SM_COPY_BLOCK + 5])
def test_sm_copy_moves_every_byte(n: int, dtype: torch.dtype) -> None:
    src = torch.randn(n, device=DEV).to(dtype)
    dst = torch.full_like(src, float("nan"))
    sm_copy(src, dst)
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


def test_sm_copy_of_nothing_launches_nothing() -> None:
    src = torch.empty(0, device=DEV)
    sm_copy(src, torch.empty_like(src))  # no program: must not raise


def test_sm_copy_refuses_mismatched_tensors() -> None:
    src = torch.zeros(8, device=DEV)
    with pytest.raises(ValueError, match="one shape and dtype"):
        sm_copy(src, torch.zeros(9, device=DEV))
    with pytest.raises(ValueError, match="one shape and dtype"):
        sm_copy(src, torch.zeros(8, device=DEV, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        sm_copy(torch.zeros(8, 2, device=DEV).t(), torch.zeros(2, 8, device=DEV))


def test_reference_is_the_faster_copy() -> None:
    slow_memcpy = CopyReference(100, torch_gbps=2600.0, sm_gbps=3700.0)
    assert slow_memcpy.best == 3700.0 and slow_memcpy.method == "sm"
    fast_memcpy = CopyReference(100, torch_gbps=4200.0, sm_gbps=4100.0)
    assert fast_memcpy.best == 4200.0 and fast_memcpy.method == "torch"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_copy_reference_measures_both_copies() -> None:
    ref = copy_reference(4 << 20)
    assert ref.total_bytes == 4 << 20
    assert ref.torch_gbps > 0 and ref.sm_gbps > 0 and ref.best == max(ref.torch_gbps, ref.sm_gbps)
    assert copy_reference(4 << 20) is ref  # measured once per size

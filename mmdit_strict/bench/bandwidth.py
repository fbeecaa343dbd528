"""The copy-bandwidth reference of the row-operator benches: how fast this device copies a given number of bytes.

Two copies of the same bytes are timed (CUDA-graph replay) and the faster one is the reference:

* ``torch``: ``dst.copy_(src)`` — a device-to-device memcpy, which the driver serves by a method of its own
  choosing, whose speed on the H200 varies with the size (from 2.6 to 4.2 TB/s; experiments/norms/), so alone
  it is no steady yardstick;
* ``sm``: :func:`sm_copy`, a plain Triton kernel that streams the bytes through the SMs in 16 KiB blocks
  (3.5–4.1 TB/s at every size on the H200).

The larger figure is the bar's denominator: a kernel is compared with the best copy the device did for those
bytes in the same run, never with a slow one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .timing import graph_ms, plain_ms

SM_COPY_BLOCK = 8192  # bf16 elements (16 KiB) per program
SM_COPY_WARPS = 8


@triton.jit
def _sm_copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def sm_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[:] = src[:] through the SMs: contiguous tensors of one dtype and size on one CUDA device."""
    if src.shape != dst.shape or src.dtype != dst.dtype or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"sm_copy: expected contiguous tensors of one shape and dtype, got {tuple(src.shape)} {src.dtype} "
                         f"and {tuple(dst.shape)} {dst.dtype}")
    n = src.numel()
    if n:
        _sm_copy_kernel[(triton.cdiv(n, SM_COPY_BLOCK),)](src, dst, n, BLOCK=SM_COPY_BLOCK, num_warps=SM_COPY_WARPS)


@dataclass(frozen=True)
class CopyReference:
    """Read + write GB/s of the two copies of ``total_bytes`` (half read, half written); ``best`` is the larger."""

    total_bytes: int
    torch_gbps: float
    sm_gbps: float

    @property
    def best(self) -> float:
        return max(self.torch_gbps, self.sm_gbps)

    @property
    def method(self) -> str:
        return "torch" if self.torch_gbps >= self.sm_gbps else "sm"


_CACHE: dict[int, CopyReference] = {}


def _ms(fn) -> float:
    """Graph-replay ms of ``fn``, or its host-launched ms where it cannot be captured."""
    return graph_ms(fn, rep=60) or plain_ms(fn)


def copy_reference(total_bytes: int, device: str | torch.device = "cuda") -> CopyReference:
    """The copy reference for a kernel that moves ``total_bytes`` (reads + writes); measured once per size."""
    n = max(1, total_bytes // 4)  # bf16 elements: n * 2 bytes read, n * 2 written
    if n not in _CACHE:
        src = torch.empty(n, dtype=torch.bfloat16, device=device).fill_(1.0)
        dst = torch.empty_like(src)
        moved = 4 * n
        t = _ms(lambda: dst.copy_(src))
        s = _ms(lambda: sm_copy(src, dst))
        _CACHE[n] = CopyReference(moved, moved / (t * 1e-3) / 1e9, moved / (s * 1e-3) / 1e9)
        del src, dst
    return _CACHE[n]

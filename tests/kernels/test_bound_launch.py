"""Bound launches (kernels/triton/bound.py): the host-side key, the plain-Python grid helpers, and on the GPU
the same bytes as Triton's own launch path with the binder skipped."""

from __future__ import annotations

import pytest
import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from mmdit_strict.kernels.triton import bound as B


def test_grid_helpers_agree_with_tritons() -> None:
    for n in list(range(0, 70)) + [127, 128, 129, 3071, 3072, 4224, 12288, 2**31 - 1, 2**31]:
        assert B.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 128, 4096):
            assert B.cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_arg_key_separates_what_triton_specializes_on() -> None:
    base = torch.zeros(64, dtype=torch.float32)
    k = B.arg_key
    assert k(base) == k(torch.ones(64, dtype=torch.float32))  # values never enter the key
    assert k(base) != k(base.to(torch.bfloat16))  # dtype
    assert k(base) != k(base[1:])  # 4-byte offset: not 16-byte aligned
    assert k(base[4:]) == k(base)  # 16-byte offset: aligned again
    assert k(1) != k(16) and k(16) != k(17)  # ints by value (a superset of 1 / divisible by 16)
    assert k(True) != k(1) and k(False) != k(0)  # bools are not ints here
    assert k(0.5) == k(2.0)  # every float is passed as fp32, its value never specialized
    assert k((1, base)) == (1, k(base)) and k((1, base)) != k((2, base))  # tuples item by item
    assert k(None) is None and k("ieee") == "ieee"
    x = torch.zeros(32, 64, dtype=torch.float32)
    d1 = TensorDescriptor(x, [32, 64], [64, 1], [16, 32])
    assert k(d1) == k(TensorDescriptor(torch.ones(32, 64), [32, 64], [64, 1], [16, 32]))
    assert k(d1) != k(TensorDescriptor(x, [32, 64], [64, 1], [16, 16]))  # block shape
    assert k(d1) != k(TensorDescriptor(x, [16, 64], [64, 1], [16, 32]))  # shape
    assert k(d1) != k(TensorDescriptor(x.to(torch.bfloat16), [32, 64], [64, 1], [16, 32]))  # dtype


def test_interpreted_kernels_keep_tritons_path() -> None:
    from mmdit_strict.kernels.triton.gemm import interpreting
    from mmdit_strict.kernels.triton.gemm import kernels as K

    assert B.bound(K._gemm_fwd_kernel) is B.bound(K._gemm_fwd_kernel)
    if interpreting():
        assert B.bound(K._gemm_fwd_kernel) is K._gemm_fwd_kernel
    else:
        assert isinstance(B.bound(K._gemm_fwd_kernel), B.BoundKernel)


@pytest.mark.gpu
def test_gpu_bound_launches_give_tritons_bytes_and_skip_its_binder() -> None:
    """On the GPU: the engine's GEMM (TMA and pointer paths, aligned and misaligned operands, M = 1, bias, LoRA,
    GELU with the pre-activation stored) and its backward give the same bytes when each launch goes through
    Triton's own path and when it reuses the bound compiled kernel; repeated calls hit the bound entries."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from mmdit_strict.kernels.triton import gemm as G
    from mmdit_strict.kernels.triton.gemm import kernels as K

    g = torch.Generator(device="cuda").manual_seed(5)
    fwd = B.bound(K._gemm_fwd_kernel)

    def run() -> list[torch.Tensor]:
        outs = []
        for dtype in (torch.bfloat16, torch.float32):
            w = torch.randn(3072, 3072, device="cuda", generator=g).to(dtype) * 0.02
            bias = torch.randn(3072, device="cuda", generator=g).to(dtype)
            la = torch.randn(64, 3072, device="cuda", generator=g).to(dtype) * 0.02
            lb = torch.randn(3072, 64, device="cuda", generator=g).to(dtype) * 0.1
            big = torch.randn(301 * 3072 + 8, device="cuda", generator=g).to(dtype)
            for m in (1, 77, 300):
                for x in (big[: m * 3072].view(m, 3072), big[1 : 1 + m * 3072].view(m, 3072)):  # aligned, misaligned
                    y, pre, u = G.gemm_fwd(x, w, bias, epilogue="gelu_tanh", lora=(la, lb, 2.0), store_pre=True)
                    dz = torch.randn(m, 3072, device="cuda", generator=g).to(dtype)
                    dx = G.gemm_bwd(dz, x.contiguous(), w, seqlens=(m,), epilogue="gelu_tanh", pre=pre,
                                    lora=(la, lb, 2.0), u=u, needs=(True, True, True, True, True))
                    outs += [y, pre, u] + [t for t in dx if t is not None]
        return outs

    state = g.get_state()
    first = run()  # every key new: Triton's path, entries bound
    hits = fwd.hits
    g.set_state(state)
    second = run()  # the same keys: bound launches
    assert fwd.hits > hits, "the second pass never reused a bound kernel"
    assert len(first) == len(second)
    for i, (a, b) in enumerate(zip(first, second)):
        bits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(a.view(bits), b.view(bits)), f"output {i} ({a.dtype}, {tuple(a.shape)}) moved"


@pytest.mark.gpu
def test_gpu_a_launch_hook_routes_through_triton() -> None:
    """With a launch hook installed (a profiler), launches go through Triton so the hook sees each one."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from triton import knobs

    from mmdit_strict.kernels.triton import gemm as G
    from mmdit_strict.kernels.triton.gemm import kernels as K

    x = torch.randn(16, 256, device="cuda")
    w = torch.randn(128, 256, device="cuda")
    G.gemm_fwd(x, w)
    G.gemm_fwd(x, w)  # bound now
    fwd = B.bound(K._gemm_fwd_kernel)
    seen: list[object] = []
    hook = knobs.runtime.launch_enter_hook
    if not hasattr(hook, "add"):
        pytest.skip("this Triton has no launch hook chain")
    hits = fwd.hits
    hook.add(seen.append)
    try:
        G.gemm_fwd(x, w)
    finally:
        hook.remove(seen.append)
    assert len(seen) == 1 and fwd.hits == hits
    G.gemm_fwd(x, w)
    assert fwd.hits == hits + 1

"""Bound launches (kernels/triton/bound.py): the plain-Python grid helpers, the GEMM engine's launch plans, and on
the GPU the same bytes as Triton's own launch path when a bound kernel is reused."""

from __future__ import annotations

import pytest
import torch
import triton

from mmdit_strict.kernels.triton import bound as B


def test_grid_helpers_agree_with_tritons() -> None:
    for n in list(range(0, 70)) + [127, 128, 129, 3071, 3072, 4224, 12288, 2**31 - 1, 2**31]:
        assert B.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 128, 4096):
            assert B.cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_interpreted_kernels_keep_tritons_path() -> None:
    from mmdit_strict.kernels.triton.gemm import interpreting
    from mmdit_strict.kernels.triton.gemm import kernels as K

    assert B.bound(K._gemm_fwd_kernel) is B.bound(K._gemm_fwd_kernel)
    if interpreting():
        assert B.bound(K._gemm_fwd_kernel) is K._gemm_fwd_kernel
    else:
        assert isinstance(B.bound(K._gemm_fwd_kernel), B.BoundKernel)


def test_gemm_launch_plans_are_keyed_on_operand_alignment() -> None:
    """The engine derives a launch plan once per key: a misaligned operand (a 4-byte offset view) gets its own plan
    (pointer loads where the aligned one takes tensor descriptors) and the same bytes; a repeat reuses the plan."""
    from mmdit_strict.kernels.triton import configs as C
    from mmdit_strict.kernels.triton.gemm import launch as L

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(3)
    w = torch.randn(48, 32, device=dev, generator=g)
    flat = torch.randn(7 * 32 + 1, device=dev, generator=g)
    aligned, misaligned = flat[: 7 * 32].clone().view(7, 32), flat[1:].view(7, 32)
    aligned.copy_(misaligned)
    cfg = C.FwdConfig(16, 32, 16, 4, 2, weight_layout="nk", tma=True)
    b = L.Operand(w, (1, 32), nk=True)
    L._PLANS.clear()
    want, _ = L._main(aligned, b, 48, cfg)
    got, _ = L._main(misaligned, b, 48, cfg)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    plans = list(L._PLANS.values())
    assert len(plans) == 2 and sorted(p.use_tma for p in plans) == [False, True]
    again, _ = L._main(misaligned, b, 48, cfg)
    assert len(L._PLANS) == 2 and torch.equal(again.view(torch.int32), got.view(torch.int32))


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

"""The fail-closed gate for GPUs the strict kernels were not qualified on (issue 33): a ROCm/HIP device, or an
NVIDIA GPU other than sm_90, gets no strict Triton kernel; strict mode names the GPU, auto falls back."""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.kernels import platform, registry
from mmdit_strict.kernels.registry import NoStrictKernelError, resolve
from mmdit_strict.kernels.runtime import Runtime

H200 = platform.GpuPlatform("nvidia", "NVIDIA H200", (9, 0))
A100 = platform.GpuPlatform("nvidia", "NVIDIA A100-SXM4-80GB", (8, 0))
MI300 = platform.GpuPlatform("amd", "AMD Instinct MI300X", (9, 4))


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch):
    """Pretend this process's CUDA device is the given platform (resolution caches cleared around it)."""

    def use(p: platform.GpuPlatform) -> None:
        monkeypatch.setattr(platform, "cuda_platform", lambda: p)
        registry._RESOLVED.clear()
        registry._DISPATCH.clear()

    yield use
    registry._RESOLVED.clear()
    registry._DISPATCH.clear()


def test_the_qualified_gpu_resolves_the_triton_kernels(gpu) -> None:
    gpu(H200)
    assert resolve("mlp_down_gemm", "cuda", torch.bfloat16, Runtime.STRICT) == (
        next(i for i in registry.implementations("mlp_down_gemm") if i.backend == "triton"), False)


def test_rocm_fails_closed_for_every_strict_operator(gpu) -> None:
    gpu(MI300)
    with pytest.raises(NoStrictKernelError, match=r"AMD Instinct MI300X \(ROCm/HIP\) is no NVIDIA GPU"):
        resolve("mlp_down_gemm", "cuda", torch.bfloat16, Runtime.STRICT)
    with pytest.raises(NoStrictKernelError, match="ROCm/HIP"):  # the eager sampling operators too
        resolve("cfg_combine_renorm", "cuda", torch.float32, Runtime.STRICT)
    impl, fell_back = resolve("mlp_down_gemm", "cuda", torch.bfloat16, Runtime.AUTO)
    assert fell_back and not impl.strict


def test_other_nvidia_gpus_fail_closed_unless_allowed(gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu(A100)
    with pytest.raises(NoStrictKernelError, match=r"qualified on sm_90 only, this is NVIDIA A100-SXM4-80GB \(sm_80\)"):
        resolve("joint_attention_fused", "cuda", torch.bfloat16, Runtime.STRICT)
    assert resolve("cfg_combine_renorm", "cuda", torch.float32, Runtime.STRICT)[0].backend == "torch_fixed"
    monkeypatch.setenv(platform.ALLOW_ENV, "1")
    gpu(A100)
    assert resolve("joint_attention_fused", "cuda", torch.bfloat16, Runtime.STRICT)[0].backend == "triton"
    gpu(MI300)  # the override never lifts the HIP check
    with pytest.raises(NoStrictKernelError, match="ROCm/HIP"):
        resolve("joint_attention_fused", "cuda", torch.bfloat16, Runtime.STRICT)


def test_production_is_never_gated(gpu) -> None:
    gpu(MI300)
    impl, fell_back = resolve("mlp_down_gemm", "cuda", torch.bfloat16, Runtime.OFF)
    assert not impl.strict and not fell_back

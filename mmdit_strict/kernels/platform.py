"""Which GPUs the strict CUDA kernels are qualified on, and the fail-closed gate for the others.

A strict kernel's bytes are a property of the code *and* the hardware that ran it: the Triton kernels
were qualified (accuracy, batch invariance, replay) on NVIDIA Hopper, sm_90 (the H200), and nowhere
else. Torch reports a ROCm (HIP) GPU as a ``"cuda"`` device too, so registering for ``"cuda"`` alone
would run them there as "strict" unqualified. The registry asks :func:`unqualified_reason` before it
resolves a strict implementation on ``cuda``:

* a ROCm / HIP build: no strict implementation (the eager FP32 sampling operators included: their
  correctly rounded elementwise claim was checked on NVIDIA only);
* an NVIDIA GPU other than sm_90: the Triton kernels are unqualified (the eager ``torch_fixed``
  sampling operators stay: they use no architecture-specific code path);
* ``MMDIT_STRICT_ALLOW_UNQUALIFIED_GPU=1`` lifts the NVIDIA architecture check (for qualifying a new
  GPU with ``mmdit-strict qualify``); it never lifts the HIP check.

Strict mode then fails closed (:class:`~.registry.NoStrictKernelError` naming the GPU); ``auto`` falls
back to the production implementation and records the fallback.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

#: NVIDIA compute capabilities every strict Triton kernel was qualified on.
QUALIFIED_CAPABILITIES = frozenset({(9, 0)})
ALLOW_ENV = "MMDIT_STRICT_ALLOW_UNQUALIFIED_GPU"


@dataclass(frozen=True)
class GpuPlatform:
    """The GPU that ``cuda`` tensors of this process live on."""

    vendor: str  # nvidia | amd
    name: str
    capability: tuple[int, int]

    @property
    def label(self) -> str:
        if self.vendor == "amd":
            return f"{self.name} (ROCm/HIP)"
        return f"{self.name} (sm_{self.capability[0]}{self.capability[1]})"


@functools.lru_cache(maxsize=1)
def cuda_platform() -> GpuPlatform | None:
    """This process's current CUDA device, or None where torch sees none."""
    if not torch.cuda.is_available():
        return None
    idx = torch.cuda.current_device()
    vendor = "amd" if getattr(torch.version, "hip", None) else "nvidia"
    return GpuPlatform(vendor, torch.cuda.get_device_name(idx), tuple(torch.cuda.get_device_capability(idx)))


def unqualified_reason(backend: str, platform: GpuPlatform | None) -> str | None:
    """Why a strict ``backend`` implementation must not run on ``platform`` (None: it may).

    ``platform`` None (no GPU visible: nothing will launch) is not refused here.
    """
    if platform is None:
        return None
    if platform.vendor != "nvidia":
        return f"{platform.label} is no NVIDIA GPU; the strict kernels are qualified on NVIDIA sm_90 only"
    if backend == "triton" and platform.capability not in QUALIFIED_CAPABILITIES and os.environ.get(ALLOW_ENV) != "1":
        qualified = ", ".join(f"sm_{a}{b}" for a, b in sorted(QUALIFIED_CAPABILITIES))
        return (f"the Triton strict kernels are qualified on {qualified} only, this is {platform.label} "
                f"(set {ALLOW_ENV}=1 to run them unqualified, e.g. to qualify them there with `mmdit-strict qualify`)")
    return None

"""Make a device's primary CUDA context current before a host tensor descriptor is encoded.

The host-side descriptor is encoded through the driver (``cuTensorMapEncodeTiled``) before Triton's
launcher binds a context, and autograd runs backward on its own device threads where no driver
context may be current yet: there (H200, Triton 3.6) the first dX of a layer without an epilogue fails
with "Failed to create tensor map descriptor: invalid device context". :func:`ensure_cuda_context`
does what Triton's launcher does (``cuCtxGetCurrent``; if none, retain and set the primary context),
once per thread and device.
"""

from __future__ import annotations

import ctypes
import threading

import torch

_DONE = threading.local()  # per thread: the device indices already made current


def ensure_cuda_context(device: torch.device) -> None:
    """Make ``device``'s primary context current on this thread (no-op after the first call per
    thread and device). Raises RuntimeError when the driver refuses."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    done = getattr(_DONE, "devices", None)
    if done is None:
        done = _DONE.devices = set()
    if idx in done:
        return
    lib = ctypes.CDLL("libcuda.so.1")
    cur = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(cur)) != 0:
        raise RuntimeError("cuCtxGetCurrent failed")
    if not cur.value:
        dev = ctypes.c_int()
        ctx = ctypes.c_void_p()
        if (lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(idx)) != 0
                or lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0 or lib.cuCtxSetCurrent(ctx) != 0):
            raise RuntimeError(f"could not make the primary CUDA context of device {idx} current")
    done.add(idx)

"""Raw-byte hashes of tensors (dtype, shape and bytes; -0.0 and +0.0 differ, as bytes do)."""

from __future__ import annotations

import hashlib

import torch

from ..io import tensor_bytes


def tensor_sha256(t: torch.Tensor) -> str:
    h = hashlib.sha256()
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(tensor_bytes(t))
    return h.hexdigest()


#: Bytes read per step of :func:`file_sha256`. Reads and hashing of large chunks run without the interpreter lock; a
#: thread hashing next to a busy one waits for the lock once per chunk, so small chunks make a background
#: checkpoint's hashing many times slower (1 MiB chunks: 16× the time beside a Python loop, for 1.6 GB).
HASH_CHUNK = 16 << 20


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place between two FP32 (or BF16) tensors, as int64."""
    if a.dtype != b.dtype:
        raise ValueError(f"ulp_distance needs equal dtypes, got {a.dtype} and {b.dtype}")
    if a.dtype == torch.float32:
        ia, ib = a.contiguous().view(torch.int32).long(), b.contiguous().view(torch.int32).long()
        top = 0x80000000
    elif a.dtype == torch.bfloat16:
        ia, ib = a.contiguous().view(torch.int16).long(), b.contiguous().view(torch.int16).long()
        top = 0x8000
    else:
        raise ValueError(f"ulp_distance supports float32 and bfloat16, got {a.dtype}")
    # map the sign-magnitude bit pattern onto a monotone integer line
    oa = torch.where(ia < 0, -(ia + top), ia)
    ob = torch.where(ib < 0, -(ib + top), ib)
    return (oa - ob).abs()

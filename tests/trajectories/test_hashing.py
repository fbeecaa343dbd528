"""Tensor and file hashes: the bytes they read, without copies where none is needed."""

from __future__ import annotations

import hashlib

import torch

from mmdit_strict.io import tensor_bytes
from mmdit_strict.trajectories import hashing
from mmdit_strict.trajectories.hashing import file_sha256, tensor_sha256


def _row_major(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_tensor_bytes_are_the_row_major_bytes_of_every_layout_and_dtype() -> None:
    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g).t(), torch.randn(5, generator=g)[::2],
             torch.randn(2, 3, generator=g).to(torch.bfloat16), torch.tensor([True, False, True]),
             torch.arange(7, dtype=torch.uint8), torch.arange(6, dtype=torch.int64).view(2, 3), torch.zeros(0, 4)]
    for t in cases:
        got = tensor_bytes(t)
        assert got.readonly and bytes(got) == _row_major(t), (t.dtype, t.shape, t.stride())


def test_tensor_bytes_of_a_contiguous_host_tensor_is_a_view_not_a_copy() -> None:
    t = torch.zeros(4, dtype=torch.float32)
    view = tensor_bytes(t)
    t[1] = 1.0
    assert bytes(view[4:8]) == torch.tensor([1.0]).numpy().tobytes()


def test_tensor_sha256_hashes_the_header_and_the_bytes() -> None:
    t = torch.arange(12, dtype=torch.float32).view(3, 4).t()
    expected = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode() + _row_major(t)).hexdigest()
    assert tensor_sha256(t) == expected


def test_file_sha256_over_several_chunks(tmp_path, monkeypatch) -> None:
    data = bytes(range(256)) * 41  # 10,496 bytes
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    monkeypatch.setattr(hashing, "HASH_CHUNK", 1000)  # 11 chunks, the last one short
    assert file_sha256(str(path)) == hashlib.sha256(data).hexdigest()

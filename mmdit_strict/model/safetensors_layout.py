"""Where each tensor's bytes lie in a safetensors file: name, dtype, shape, absolute offset and length.

The format is an 8-byte little-endian header length, a JSON header mapping names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the header), then the
raw little-endian bytes. Reading the header alone lets a loader fetch each tensor's bytes with positional
reads straight into memory it owns (a pinned staging buffer, a parameter), with no mapping of the file.
Callers validate the files with ``safetensors.safe_open`` first (``checkpoint.check_headers``); this
module still refuses a header whose offsets leave the file, naming the file.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

#: safetensors dtype names of the floating dtypes a checkpoint may store, as torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class LayoutError(ValueError):
    """A safetensors file whose header cannot describe it (or that ends inside a tensor); ``path`` names it."""

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class TensorSpan:
    """One stored tensor: its bytes are ``file[offset : offset + nbytes]``."""

    key: str
    file: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def file_spans(path: Path) -> list[TensorSpan]:
    """Every tensor of one safetensors file, in file order. Raises :class:`LayoutError` for a header
    that is not JSON, names a dtype outside :data:`DTYPES`, or whose offsets disagree with the shapes or
    run past the end of the file."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise LayoutError(f"{path} is shorter than a safetensors header", path)
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise LayoutError(f"{path}: header length {n} runs past the end of the file ({size} bytes)", path)
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise LayoutError(f"{path}: header is not JSON: {exc}", path) from exc
    base = 8 + n
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise LayoutError(f"{path}: tensor {key} has dtype {info.get('dtype')!r}, not a floating dtype", path)
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(v) for v in info["data_offsets"])
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0 or base + end > size:
            raise LayoutError(f"{path}: tensor {key} has offsets {begin}..{end} for {nbytes} bytes in a {size}-byte file",
                              path)
        spans.append(TensorSpan(key, path, base + begin, nbytes, dtype, shape))
    return sorted(spans, key=lambda s: s.offset)

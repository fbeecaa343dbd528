"""File writes every layer uses: atomic writes (temp file in the same folder, fsync, rename into place) and
byte-stable safetensors files (the same tensors and metadata always give the same file bytes)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)`` and move the result onto ``path`` atomically; a crash leaves the old file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        write(tmp_path)
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_path, 0o666 & ~umask)  # mkstemp makes 0600 files; give them the usual mode
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text))


def replace_dir(tmp: str | Path, directory: str | Path) -> Path:
    """Move the finished folder ``tmp`` onto ``directory`` (its sibling), replacing what was there.

    The old folder is renamed aside first and removed after, so ``directory`` is at every moment
    either the old folder or the new one, never a mix.
    """
    tmp, directory = Path(tmp), Path(directory)
    if directory.exists():
        old = directory.with_name(f".{directory.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, directory)
    return directory


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t`` in row-major order, on the host: a read-only view of ``t``'s own memory when it is a
    contiguous CPU tensor (no copy: hashing and writing take it as it is), else of a contiguous host copy."""
    t = t.detach().to("cpu").contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).toreadonly()


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` as a safetensors file whose bytes depend only on names, dtypes, shapes and values.

    The header is JSON with every key sorted (``__metadata__`` included) and no spaces, padded with
    spaces to a multiple of 8 bytes; tensor data follows in name order. (The safetensors library's
    own writer orders the metadata through a hash map, so two writes of the same tensors can differ.)
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    ordered = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"cannot store tensor {name!r} of dtype {t.dtype} in safetensors")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        ordered.append(t)
        offset += size
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as fh:
        fh.write(len(text).to_bytes(8, "little"))
        fh.write(text)
        for t in ordered:
            fh.write(tensor_bytes(t))

"""diffusers-format checkpoints: resolve (local folder or hub id), validate, load, save atomically.

Layout: ``config.json`` plus ``diffusion_pytorch_model.safetensors`` or shards listed in
``diffusion_pytorch_model.safetensors.index.json``. Every tensor is checked against the model's own
state dict: missing, unexpected and mis-shaped tensors are reported by name, from the headers alone.
Loading builds the model on the ``meta`` device and reads every tensor straight into its final place
(``weight_reader.py``: parallel positional reads, pinned staging for a GPU, one cast on the device), so
host memory beyond the loaded model stays bounded by the staging buffers (a 20 B checkpoint never needs
a host copy of its weights, in any dtype).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..config.arch import ArchConfig
from ..io import replace_dir
from ..kernels.runtime import Runtime
from .safetensors_layout import LayoutError, file_spans
from .weight_reader import read_tensors

if TYPE_CHECKING:
    from .mmdit import MMDiT

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
CONFIG_NAME = "config.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, truncated or does not match the architecture."""


def resolve_checkpoint_dir(
    path_or_repo_id: str | Path, subfolder: str | None = None, revision: str | None = None, local_files_only: bool | None = None
) -> Path:
    """Return the local folder holding ``config.json`` and the weights.

    A local folder is used as is (or its ``transformer/`` subfolder for a pipeline folder); anything
    else is a hub repo id downloaded through huggingface_hub, from the cache only when offline
    (``HF_HUB_OFFLINE=1`` or ``local_files_only=True``).
    """
    p = Path(path_or_repo_id).expanduser()
    if p.exists():
        if not p.is_dir():
            raise CheckpointError(f"{p} is a file; pass the folder that holds {CONFIG_NAME} and the safetensors")
        folder = p / subfolder if subfolder else p
        if not (folder / CONFIG_NAME).exists() and subfolder is None and (p / "transformer" / CONFIG_NAME).exists():
            folder = p / "transformer"
        if not (folder / CONFIG_NAME).exists():
            raise CheckpointError(f"no {CONFIG_NAME} in {folder}: not a diffusers transformer folder")
        return folder
    repo_id = str(path_or_repo_id)
    if repo_id.count("/") != 1 or repo_id.startswith(("/", ".")):
        raise CheckpointError(f"{repo_id!r} is neither an existing folder nor a hub repo id (owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = local_files_only if local_files_only is not None else os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    sub = subfolder if subfolder is not None else "transformer"
    try:
        root = Path(
            snapshot_download(
                repo_id, revision=revision, local_files_only=offline,
                allow_patterns=[f"{sub}/*", CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME, "*.safetensors"] if sub else None,
            )
        )
    except LocalEntryNotFoundError as exc:
        raise CheckpointError(
            f"{repo_id} is not in the local Hugging Face cache and the hub is offline or unreachable; "
            "download it where there is a network (huggingface-cli download) or pass a local folder"
        ) from exc
    except Exception as exc:  # network, auth, missing repo: one clear message
        raise CheckpointError(f"could not fetch {repo_id} from the hub: {exc}") from exc
    for folder in (root / sub, root):
        if (folder / CONFIG_NAME).exists():
            return folder
    raise CheckpointError(f"{repo_id} has no {CONFIG_NAME} under {sub or 'the root'}")


def _weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).exists()]
        if missing:
            raise CheckpointError(f"shards listed in {index.name} are missing: {missing}")
        return [folder / f for f in files]
    single = folder / WEIGHTS_NAME
    if single.exists():
        return [single]
    others = sorted(folder.glob("*.safetensors"))
    if others:
        return others
    raise CheckpointError(f"no safetensors weights in {folder} (expected {WEIGHTS_NAME} or {INDEX_NAME})")


def _each_tensor(files: Iterable[Path], visit: Callable[[Path, Any, str], None]) -> None:
    """``visit(file, open safetensors handle, key)`` for every tensor of every file, files in order, keys in
    header order. Raises :class:`CheckpointError` for a key in more than one file, and, naming the file,
    for a corrupt, truncated or unreadable one (also when ``visit`` hits it while reading)."""
    seen: set[str] = set()
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                for key in fh.keys():
                    if key in seen:
                        raise CheckpointError(f"tensor {key} appears in more than one shard ({f.name})")
                    seen.add(key)
                    visit(f, fh, key)
        except SafetensorError as exc:
            raise CheckpointError(f"{f} is corrupt or truncated: {exc}") from exc
        except (OSError, RuntimeError) as exc:
            raise CheckpointError(f"could not read {f}: {exc}") from exc


def read_state_dict(files: Iterable[Path]) -> dict[str, torch.Tensor]:
    """Read every tensor; a corrupt or truncated file raises :class:`CheckpointError` naming it."""
    state: dict[str, torch.Tensor] = {}

    def read(_f: Path, fh: Any, key: str) -> None:
        state[key] = fh.get_tensor(key)

    _each_tensor(files, read)
    return state


def _clip(items: list[str], n: int = 8) -> str:
    return ", ".join(items[:n]) + (f", … (+{len(items) - n} more)" if len(items) > n else "")


_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def check_headers(model: torch.nn.Module, files: Iterable[Path]) -> dict[str, Path]:
    """Validate names, shapes and dtypes from the safetensors headers alone (no tensor is read).

    Returns the file holding each tensor. Raises :class:`CheckpointError` naming every missing,
    unexpected, mis-shaped or non-floating tensor, a tensor stored twice, or an unreadable file.
    """
    where: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    bad_dtype: list[str] = []

    def header(f: Path, fh: Any, key: str) -> None:
        sl = fh.get_slice(key)
        where[key] = f
        shapes[key] = tuple(int(n) for n in sl.get_shape())
        if sl.get_dtype() not in _FLOAT_DTYPES:
            bad_dtype.append(key)

    _each_tensor(files, header)
    _require_match(model, shapes, bad_dtype)
    return where


def _require_match(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]], non_float: list[str]) -> None:
    """Raise :class:`CheckpointError` naming every missing, unexpected, mis-shaped or non-floating tensor."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    misshaped = sorted(
        f"{k}: checkpoint {shapes[k]} vs model {expected[k]}" for k in set(expected) & set(shapes) if shapes[k] != expected[k]
    )
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_clip(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {_clip(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped tensors ({len(misshaped)}): {_clip(misshaped)}")
    if non_float:
        problems.append(f"non-floating tensors: {_clip(sorted(non_float))}")
    if problems:
        raise CheckpointError("checkpoint does not match the architecture: " + "; ".join(problems))


def load_state_dict_lazily(
    model: torch.nn.Module, files: Sequence[Path], device: torch.device, dtype: torch.dtype, *, workers: int | None = None
) -> dict[str, torch.Tensor]:
    """Read the checkpoint straight into new tensors of ``dtype`` on ``device``.

    Headers are validated first (:func:`check_headers`: names, shapes, dtypes, duplicates, corrupt or
    truncated files); then ``weight_reader.read_tensors`` reads the tensors with several threads through
    bounded staging buffers (pinned for a CUDA target), casting each once, on the device, and checking each
    finite in its stored dtype. Host memory beyond the result is the staging buffers (no mapped shard, no
    whole-checkpoint copy in any dtype; ``tests/model/test_load_memory.py`` measures it).
    """
    check_headers(model, files)
    spans = []
    try:
        for f in files:
            spans += file_spans(f)
        result = read_tensors(spans, device, dtype, workers=workers)
    except LayoutError as exc:
        raise CheckpointError(f"{exc.path} is corrupt or truncated: {exc}") from exc
    except OSError as exc:
        raise CheckpointError(f"could not read {exc.filename or 'a shard'}: {exc}") from exc
    if result.nonfinite:
        raise CheckpointError(f"checkpoint tensors contain NaN/Inf: {_clip(result.nonfinite)}")
    return result.tensors


def resolve_dtype(
    torch_dtype: torch.dtype | str | None, dtype: torch.dtype | str | None, *, allow_auto: bool = False
) -> torch.dtype | str:
    """The execution dtype from diffusers' ``torch_dtype=`` and our ``dtype=`` alias (FP32 when neither).

    Strings name torch dtypes (``"bfloat16"``, ``"torch.float32"``); ``"auto"`` (when ``allow_auto``)
    is returned as is and means the checkpoint's stored dtype (:func:`stored_dtype`). Both given and
    different: ValueError.
    """
    def parse(v: torch.dtype | str | None, name: str) -> torch.dtype | str | None:
        if v is None or isinstance(v, torch.dtype):
            return v
        if v == "auto":
            if not allow_auto:
                raise ValueError(f"{name}='auto' needs a checkpoint to read the dtype from (use from_pretrained)")
            return v
        if isinstance(v, str):
            attr = getattr(torch, v.removeprefix("torch."), None)
            if isinstance(attr, torch.dtype):
                return attr
        raise ValueError(f"{name}={v!r} is not a torch dtype (use torch.float32 or torch.bfloat16)")

    a, b = parse(torch_dtype, "torch_dtype"), parse(dtype, "dtype")
    if a is not None and b is not None and a != b:
        raise ValueError(f"torch_dtype={a} and dtype={b} disagree; dtype is an alias of torch_dtype, pass one")
    out = a or b or torch.float32
    if out != "auto" and out not in (torch.float32, torch.bfloat16):
        raise ValueError(f"execution dtype must be torch.float32 or torch.bfloat16, got {out}")
    return out


_STORED = {"F32": torch.float32, "BF16": torch.bfloat16}


def stored_dtype(files: Iterable[Path]) -> torch.dtype:
    """The dtype most of the checkpoint's tensors are stored in (``torch_dtype="auto"``); FP32 or BF16 only."""
    from collections import Counter

    counts: Counter[str] = Counter()
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                counts.update(fh.get_slice(k).get_dtype() for k in fh.keys())
        except SafetensorError as exc:
            raise CheckpointError(f"{f} is corrupt or truncated: {exc}") from exc
    if not counts:
        raise CheckpointError("the checkpoint holds no tensors")
    name = counts.most_common(1)[0][0]
    if name not in _STORED:
        raise ValueError(f"torch_dtype='auto': the checkpoint is stored in {name}, not an execution dtype; "
                         "pass torch_dtype=torch.bfloat16 or torch.float32")
    return _STORED[name]


def load_pretrained(
    cls: type["MMDiT"],
    path_or_repo_id: str | Path,
    *,
    runtime: str | Runtime,
    dtype: torch.dtype | str,
    device: str | torch.device,
    subfolder: str | None,
    revision: str | None,
    local_files_only: bool | None,
) -> "MMDiT":
    if dtype != "auto" and dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"execution dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    folder = resolve_checkpoint_dir(path_or_repo_id, subfolder, revision, local_files_only)
    if dtype == "auto":
        dtype = stored_dtype(_weight_files(folder))
    try:
        raw_cfg = json.loads((folder / CONFIG_NAME).read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{folder / CONFIG_NAME} is not valid JSON: {exc}") from exc
    arch = ArchConfig.from_diffusers_config(raw_cfg)
    with torch.device("meta"):
        model = cls(arch, runtime=runtime)
    state = load_state_dict_lazily(model, _weight_files(folder), torch.device(device), dtype)  # type: ignore[arg-type]
    model.load_state_dict(state, strict=True, assign=True)
    model.checkpoint_path = str(folder)  # type: ignore[attr-defined]
    return model.eval()


def save_pretrained(model: "MMDiT", directory: str | Path, max_shard_size: int = 2 * 1024**3) -> Path:
    """Write config + weights into ``directory`` atomically (a temp folder renamed into place)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(state):
        nbytes = state[k].numel() * state[k].element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][k] = state[k]
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        total = sum(v.numel() * v.element_size() for v in state.values())
        (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (tmp / CONFIG_NAME).write_text(json.dumps(model.config.to_diffusers_config(), indent=2))
    return replace_dir(tmp, directory)


_HOST = threading.local()  # per hashing thread: a pinned staging buffer and a copy stream


def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bytes on the host as a flat uint8 tensor (a view of a reused pinned buffer for GPU tensors)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        return flat
    n = flat.numel()
    buf = getattr(_HOST, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _HOST.buf = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        _HOST.stream = torch.cuda.Stream(flat.device)
    _HOST.stream.wait_stream(torch.cuda.current_stream(flat.device))
    with torch.cuda.stream(_HOST.stream):
        buf[:n].copy_(flat, non_blocking=True)  # pinned: a DMA copy at link speed, concurrent across threads
    _HOST.stream.synchronize()
    return buf[:n]


def _tensor_digest(t: torch.Tensor) -> bytes:
    """sha256 of one tensor's raw bytes, in memory order of its contiguous form."""
    h = hashlib.sha256()
    if t.numel():
        h.update(_host_bytes(t).numpy())  # buffer protocol: no second host copy
    return h.digest()


def state_dict_hash(state: dict[str, torch.Tensor], *, workers: int | None = None) -> str:
    """sha256 over the name-ordered records (name, dtype, shape, sha256 of the raw bytes) of every tensor.

    The per-tensor digests run on a thread pool (device→host copies and hashlib both release the GIL),
    one tensor in flight per worker, so a 20 B-parameter model on a GPU hashes in seconds and never
    needs a host copy of the whole state. The result depends only on names, dtypes, shapes and bytes.
    """
    names = sorted(state)
    workers = workers or min(16, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        digests = list(pool.map(lambda k: _tensor_digest(state[k]), names))
    h = hashlib.sha256()
    for k, d in zip(names, digests):
        t = state[k]
        h.update(k.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(d)
    return h.hexdigest()

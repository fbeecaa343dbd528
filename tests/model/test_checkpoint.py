"""Checkpoint IO: sharded diffusers checkpoints, offline hub ids, clear errors, our save round trip."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmdit_strict import MMDiT
from mmdit_strict.model.checkpoint import INDEX_NAME, WEIGHTS_NAME, CheckpointError
from mmdit_strict.tolerances import tolerance
from tests.harness import assert_bytes_equal
from tests.helpers import TINY_DIFFUSERS_KWARGS, make_diffusers_checkpoint, make_inputs


def _state_equal(model: torch.nn.Module, reference: torch.nn.Module, what: str) -> None:
    ours, theirs = model.state_dict(), reference.state_dict()
    assert sorted(ours) == sorted(theirs), f"{what}: parameter names differ"
    for k in ours:
        assert_bytes_equal(ours[k], theirs[k].to(ours[k].dtype), f"{what}: {k}")


@pytest.fixture(scope="module")
def sharded_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded") / "transformer"
    model = make_diffusers_checkpoint(path, seed=3, max_shard_size="50KB", **TINY_DIFFUSERS_KWARGS)
    return path, model


def _copy(src: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------------------------- loading


def test_single_file_checkpoint_loads(tiny_ckpt):
    path, ref = tiny_ckpt
    assert (path / WEIGHTS_NAME).exists()
    _state_equal(MMDiT.from_pretrained(path), ref, "single-file load")


def test_sharded_checkpoint_loads(sharded_ckpt):
    path, ref = sharded_ckpt
    index = json.loads((path / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 2, "the fixture should write several shards"
    model = MMDiT.from_pretrained(path)
    _state_equal(model, ref, "sharded load")
    inputs = make_inputs(1, (4, 4), [6], seed=1)
    with torch.no_grad():
        ok, max_abs, _ = tolerance("checkpoint", "sharded_vs_single", torch.float32).check(model(**inputs).sample, ref(**inputs).sample)
    assert ok, max_abs


def test_pipeline_folder_uses_transformer_subfolder(tiny_ckpt, tmp_path):
    path, ref = tiny_ckpt
    pipe = tmp_path / "pipeline"
    shutil.copytree(path, pipe / "transformer")
    (pipe / "model_index.json").write_text("{}")
    _state_equal(MMDiT.from_pretrained(pipe), ref, "pipeline folder")


def test_bf16_load_casts_once(tiny_ckpt):
    path, ref = tiny_ckpt
    model = MMDiT.from_pretrained(path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert_bytes_equal(model.img_in.weight, ref.img_in.weight.to(torch.bfloat16), "bf16 img_in.weight")


def _stored(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _reader_cases():
    """(workers, chunk_bytes): the defaults, and tiny staging (rounded down to 192 bytes) that splits tensors and groups neighbours."""
    return [(None, None), (3, 200)]


@pytest.mark.parametrize("workers,chunk", _reader_cases())
def test_parallel_reader_gives_the_stored_bytes(sharded_ckpt, tmp_path, workers, chunk):
    """Every dtype path (FP32 file → FP32, FP32 → BF16, BF16 file → FP32) gives what a plain read + one
    ``Tensor.to`` gives, whatever the thread count and staging size; so does from_pretrained."""
    from mmdit_strict.model.safetensors_layout import file_spans
    from mmdit_strict.model.weight_reader import read_tensors

    bf16_dir = MMDiT.from_pretrained(sharded_ckpt[0], dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16", max_shard_size=40 * 1024)
    for folder, dtype in ((sharded_ckpt[0], torch.float32), (sharded_ckpt[0], torch.bfloat16), (bf16_dir, torch.float32)):
        stored = _stored(folder)
        spans = [s for f in sorted(folder.glob("*.safetensors")) for s in file_spans(f)]
        got = read_tensors(spans, torch.device("cpu"), dtype, workers=workers, chunk_bytes=chunk)
        assert got.nonfinite == [] and sorted(got.tensors) == sorted(stored)
        for k, v in stored.items():
            assert torch.equal(got.tensors[k], v.to(dtype)), f"{folder.name} → {dtype}: {k}"
    model = MMDiT.from_pretrained(bf16_dir, dtype=torch.float32)
    for k, v in _stored(bf16_dir).items():
        assert torch.equal(model.state_dict()[k], v.to(torch.float32)), k


@pytest.mark.gpu
def test_gpu_load_gives_the_cpu_bytes(sharded_ckpt, tmp_path):
    """The pinned-staging CUDA path (default and tiny staging, several streams, the on-device cast) gives the
    CPU load's bytes for every dtype path, and names a NaN as the CPU path does."""
    from mmdit_strict.model.safetensors_layout import file_spans
    from mmdit_strict.model.weight_reader import read_tensors

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    bf16_dir = MMDiT.from_pretrained(sharded_ckpt[0], dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16", max_shard_size=40 * 1024)
    for folder, dtype in ((sharded_ckpt[0], torch.float32), (sharded_ckpt[0], torch.bfloat16), (bf16_dir, torch.float32)):
        ref = MMDiT.from_pretrained(folder, dtype=dtype).state_dict()
        spans = [s for f in sorted(folder.glob("*.safetensors")) for s in file_spans(f)]
        for workers, chunk in _reader_cases():
            got = read_tensors(spans, torch.device("cuda"), dtype, workers=workers, chunk_bytes=chunk)
            assert got.nonfinite == []
            for k, v in ref.items():
                assert got.tensors[k].is_cuda and torch.equal(got.tensors[k].cpu(), v), f"{folder.name} → {dtype}: {k}"
        model = MMDiT.from_pretrained(folder, dtype=dtype, device="cuda")
        assert all(torch.equal(v.cpu(), ref[k]) for k, v in model.state_dict().items())
    poisoned = _copy(bf16_dir, tmp_path, "poisoned")
    shard = sorted(poisoned.glob("*.safetensors"))[0]
    state = load_file(str(shard))
    key = sorted(state)[0]
    state[key].view(-1)[0] = float("inf")
    save_file(state, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"NaN/Inf: {key}"):
        MMDiT.from_pretrained(poisoned, dtype=torch.float32, device="cuda")


def test_reads_land_only_in_parameters_or_the_bounded_stage(sharded_ckpt, monkeypatch):
    """No host copy of a tensor beside its parameter: each read fills a parameter's own memory (dtypes
    agree) or the worker's staging buffer of at most HOST_CHUNK_BYTES (a cast)."""
    import numpy as np

    from mmdit_strict.model import weight_reader

    reads: list[tuple[int, int]] = []
    real = weight_reader._pread

    def spy(fd, buf, offset, path):
        reads.append((np.frombuffer(buf, dtype=np.uint8).ctypes.data, len(buf)))
        real(fd, buf, offset, path)

    monkeypatch.setattr(weight_reader, "_pread", spy)
    for dtype in (torch.float32, torch.bfloat16):  # the fixture stores FP32
        reads.clear()
        model = MMDiT.from_pretrained(sharded_ckpt[0], dtype=dtype)
        spans = [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in model.parameters()]
        in_param = [any(a <= addr and addr + n <= b for a, b in spans) for addr, n in reads]
        if dtype == torch.float32:
            assert all(in_param) and len(reads) == len(spans)
        else:
            assert not any(in_param) and max(n for _, n in reads) <= weight_reader.HOST_CHUNK_BYTES


def test_shard_cut_short_after_validation_is_named(tiny_ckpt, tmp_path):
    """The reader itself names a file that ends inside a tensor (cut between the header check and the read)."""
    from mmdit_strict.model.safetensors_layout import LayoutError, file_spans
    from mmdit_strict.model.weight_reader import read_tensors

    f = _copy(tiny_ckpt[0], tmp_path) / WEIGHTS_NAME
    spans = file_spans(f)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 8])
    with pytest.raises(LayoutError, match=f"{WEIGHTS_NAME} ended at byte"):
        read_tensors(spans, torch.device("cpu"), torch.float32, workers=2)
    with pytest.raises(LayoutError, match=f"{WEIGHTS_NAME}: tensor .* offsets"):
        file_spans(f)


def _fake_hub_cache(root: Path, repo_id: str, src: Path, revision: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """huggingface_hub's cache layout: ``models--owner--name/{refs/main, snapshots/<rev>/transformer/...}``."""
    repo_dir = root / f"models--{repo_id.replace('/', '--')}"
    snap = repo_dir / "snapshots" / revision
    shutil.copytree(src, snap / "transformer")
    (snap / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(revision)
    return snap


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_id_resolves_from_offline_cache(sharded_ckpt, offline_cache):
    path, ref = sharded_ckpt
    _fake_hub_cache(offline_cache, "owner/tiny-qwen", path)
    model = MMDiT.from_pretrained("owner/tiny-qwen")
    _state_equal(model, ref, "hub id from the offline cache")
    assert "models--owner--tiny-qwen" in model.checkpoint_path


def test_unknown_hub_id_offline_is_clear(offline_cache):
    with pytest.raises(CheckpointError, match="nobody/nothing.*(cache|offline)"):
        MMDiT.from_pretrained("nobody/nothing")


def test_neither_folder_nor_repo_id(tmp_path):
    with pytest.raises(CheckpointError, match="neither an existing folder nor a hub repo id"):
        MMDiT.from_pretrained(str(tmp_path / "missing" / "deeper" / "folder"))


# ---------------------------------------------------------------------------------------------- errors


def _rewrite(folder: Path, edit) -> None:
    f = folder / WEIGHTS_NAME
    state = load_file(str(f))
    edit(state)
    save_file(state, str(f), metadata={"format": "pt"})


def test_missing_tensor_is_named(tiny_ckpt, tmp_path):
    ckpt = _copy(tiny_ckpt[0], tmp_path)
    _rewrite(ckpt, lambda s: s.pop("transformer_blocks.1.attn.to_k.bias"))
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): transformer_blocks\.1\.attn\.to_k\.bias"):
        MMDiT.from_pretrained(ckpt)


def test_unexpected_tensor_is_named(tiny_ckpt, tmp_path):
    ckpt = _copy(tiny_ckpt[0], tmp_path)
    _rewrite(ckpt, lambda s: s.__setitem__("transformer_blocks.0.extra.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \(1\): transformer_blocks\.0\.extra\.weight"):
        MMDiT.from_pretrained(ckpt)


def test_misshaped_tensor_is_named(tiny_ckpt, tmp_path):
    ckpt = _copy(tiny_ckpt[0], tmp_path)
    _rewrite(ckpt, lambda s: s.__setitem__("proj_out.weight", torch.zeros(64, 31)))
    with pytest.raises(CheckpointError, match=r"mis-shaped.*proj_out\.weight: checkpoint \(64, 31\) vs model \(64, 32\)"):
        MMDiT.from_pretrained(ckpt)


def test_nonfinite_tensor_is_named(tiny_ckpt, tmp_path):
    ckpt = _copy(tiny_ckpt[0], tmp_path)

    def poison(s):
        s["img_in.bias"][3] = float("nan")

    _rewrite(ckpt, poison)
    with pytest.raises(CheckpointError, match=r"NaN/Inf: img_in\.bias"):
        MMDiT.from_pretrained(ckpt)


def test_corrupt_header(tiny_ckpt, tmp_path):
    ckpt = _copy(tiny_ckpt[0], tmp_path)
    f = ckpt / WEIGHTS_NAME
    data = bytearray(f.read_bytes())
    data[8:40] = b"\xff" * 32  # the JSON header starts at byte 8
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        MMDiT.from_pretrained(ckpt)


def test_truncated_file(tiny_ckpt, tmp_path):
    ckpt = _copy(tiny_ckpt[0], tmp_path)
    f = ckpt / WEIGHTS_NAME
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{WEIGHTS_NAME}.*corrupt or truncated"):
        MMDiT.from_pretrained(ckpt)


def test_tensor_in_two_shards_and_truncated_shard_are_named(tmp_path):
    """Both shard readers (headers only, and every tensor) refuse a tensor stored twice and name a truncated file."""
    from mmdit_strict.model.checkpoint import check_headers, read_state_dict

    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"w": torch.zeros(2), "u": torch.ones(3)}, str(a))
    save_file({"w": torch.ones(2)}, str(b))
    with pytest.raises(CheckpointError, match=r"tensor w appears in more than one shard \(b\.safetensors\)"):
        check_headers(torch.nn.Linear(2, 2), [a, b])
    with pytest.raises(CheckpointError, match=r"tensor w appears in more than one shard \(b\.safetensors\)"):
        read_state_dict([a, b])
    assert_bytes_equal(read_state_dict([a])["u"], torch.ones(3), "u read back")
    data = b.read_bytes()
    b.write_bytes(data[: len(data) - 4])
    with pytest.raises(CheckpointError, match=r"b\.safetensors is corrupt or truncated"):
        read_state_dict([a, b])
    with pytest.raises(CheckpointError, match=r"b\.safetensors is corrupt or truncated"):
        check_headers(torch.nn.Linear(2, 2), [a, b])


def test_missing_shard(sharded_ckpt, tmp_path):
    ckpt = _copy(sharded_ckpt[0], tmp_path)
    shard = sorted(ckpt.glob("*-of-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shards listed in {INDEX_NAME} are missing.*{shard.name}"):
        MMDiT.from_pretrained(ckpt)


def test_corrupt_index(sharded_ckpt, tmp_path):
    ckpt = _copy(sharded_ckpt[0], tmp_path)
    (ckpt / INDEX_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="not a valid safetensors index"):
        MMDiT.from_pretrained(ckpt)


def test_no_config(tiny_ckpt, tmp_path):
    ckpt = _copy(tiny_ckpt[0], tmp_path)
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        MMDiT.from_pretrained(ckpt)


def test_no_weights(tiny_ckpt, tmp_path):
    ckpt = _copy(tiny_ckpt[0], tmp_path)
    (ckpt / WEIGHTS_NAME).unlink()
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        MMDiT.from_pretrained(ckpt)


def test_config_outside_contract(tiny_ckpt, tmp_path):
    ckpt = _copy(tiny_ckpt[0], tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["guidance_embeds"] = True
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="guidance_embeds"):
        MMDiT.from_pretrained(ckpt)


def test_unsupported_dtype(tiny_ckpt):
    with pytest.raises(ValueError, match="torch.float32 or torch.bfloat16"):
        MMDiT.from_pretrained(tiny_ckpt[0], dtype=torch.float16)


# ------------------------------------------------------------------------------------------ round trip


@pytest.mark.parametrize("max_shard_size", [2 * 1024**3, 40 * 1024])
def test_save_pretrained_round_trip(tiny_ckpt, tmp_path, max_shard_size):
    from diffusers import QwenImageTransformer2DModel

    path, ref = tiny_ckpt
    model = MMDiT.from_pretrained(path)
    out = model.save_pretrained(tmp_path / "saved", max_shard_size=max_shard_size)
    sharded = (out / INDEX_NAME).exists()
    assert sharded == (max_shard_size < 1024**2), "sharding should follow max_shard_size"
    _state_equal(MMDiT.from_pretrained(out), model, "our save → our load")
    theirs = QwenImageTransformer2DModel.from_pretrained(str(out)).float().eval()
    _state_equal(model, theirs, "our save → diffusers load")
    inputs = make_inputs(2, (4, 6), [3, 8], seed=2)
    with torch.no_grad():
        assert_bytes_equal(theirs(**inputs).sample, ref(**inputs).sample, "diffusers forward on our saved weights")


def test_save_pretrained_replaces_existing_folder(tiny_ckpt, tmp_path):
    model = MMDiT.from_pretrained(tiny_ckpt[0])
    target = tmp_path / "saved"
    target.mkdir()
    (target / "stale.safetensors").write_bytes(b"junk")
    model.save_pretrained(target)
    assert not (target / "stale.safetensors").exists()
    _state_equal(MMDiT.from_pretrained(target), model, "overwritten save")


def test_state_dict_hash_is_content_only_and_thread_count_free():
    from mmdit_strict.model import state_dict_hash

    g = torch.Generator().manual_seed(0)
    state = {f"blocks.{i}.w": torch.randn(33, 17, generator=g).to(torch.bfloat16) for i in range(6)}
    state["empty"] = torch.empty(0)
    base = state_dict_hash(state, workers=1)
    assert state_dict_hash(dict(reversed(list(state.items()))), workers=4) == base
    flipped = {k: v.clone() for k, v in state.items()}
    flipped["blocks.3.w"].view(torch.int16)[5, 7] ^= 1  # one bit of one element
    assert state_dict_hash(flipped) != base
    renamed = {("blocks.9.w" if k == "blocks.3.w" else k): v for k, v in state.items()}
    assert state_dict_hash(renamed) != base
    retyped = dict(state, **{"blocks.0.w": state["blocks.0.w"].view(torch.float16)})  # same bytes, other dtype
    assert state_dict_hash(retyped) != base


@pytest.mark.gpu
def test_state_dict_hash_same_on_gpu_and_cpu():
    """The pinned-buffer device→host path hashes the same bytes as the host path, across threads."""
    from mmdit_strict.model import state_dict_hash

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(257 * (i + 1), 129, generator=g).to(torch.bfloat16) for i in range(12)}
    state["t"] = torch.randn(5, 7, generator=g).t()  # non-contiguous
    on_gpu = {k: v.cuda() for k, v in state.items()}
    assert state_dict_hash(on_gpu, workers=4) == state_dict_hash(state, workers=1)

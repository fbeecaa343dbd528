"""``train`` under torchrun (gloo on the CPU): the same LoRA bytes for any number of ranks and micro-batch.

Real ``torchrun --standalone`` subprocesses of the CLI on ``experiment=grpo_tiny`` cut to two epochs (the 4-rank
job's rollout under a model-parallel layout, ``sample.parallel``).
The single-process reference runs once per module, with one thread like torchrun's workers. Four
multi-rank launches in all: 2 ranks (micro-batches of 4, state hashes compared after every update),
4 ranks (micro-batches of 2), and a 2-rank job whose rank 1 dies mid-update, resumed by one process.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.distributed.test_torchrun import ok, plain, sha, torchrun

TINY = ["--quiet", "experiment=grpo_tiny", "train.num_epochs=2", "train.save_freq=1", "train.eval_freq=2",
        "wandb.mode=disabled", "distributed.timeout_s=60"]
ADAPTERS = ("lora/peft/adapter_model.safetensors", "lora/diffusers/pytorch_lora_weights.safetensors")
#: metrics that describe one rank's memory or the exchange, not the run's numbers
PER_RANK = ("grad_sink_peak_buffer_mb", "grad_sink_bound_per_param", "grad_sink_peak_per_param",
            "grad_sink_peak_tree_nodes", "peak_memory_mb", "peak_memory_reserved_mb", "peak_memory_rollout_mb", "peak_memory_train_mb",
            "peak_memory_reserved_rollout_mb", "peak_memory_reserved_train_mb", "world_size", "comm_bytes", "comm_bytes_per_update",
            "rollout_exchanges")


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _numbers(row: dict) -> dict:
    # cuda_graphs/*: how many captures and replays served this process, which depends on its share of the work
    return {k: v for k, v in row.items()
            if not k.startswith(("time_", "cuda_graphs/")) and k not in PER_RANK}


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process, micro-batches of 4 pairs (grpo_tiny's): the bytes every multi-rank run is held to."""
    out = tmp_path_factory.mktemp("train1")
    ok(plain("train", f"output_dir={out}", *TINY))
    return out


def _same_training(got: Path, want: Path) -> None:
    for rel in ADAPTERS:
        assert sha(got / rel) == sha(want / rel), rel
    assert sha(got / "checkpoints" / "epoch_000001" / "lora.safetensors") == sha(want / "checkpoints" / "epoch_000001" / "lora.safetensors")
    assert [_numbers(r) for r in _rows(got)] == [_numbers(r) for r in _rows(want)]


@pytest.mark.slow
@pytest.mark.parametrize("ranks, extra", [(2, ["distributed.check_state=update"]),
                                          (4, ["train.micro_batch=2", "train.gradient_accumulation_steps=12",
                                               "sample.parallel.sp=2", "sample.parallel.cfg=2",
                                               "sample.parallel.attention=allgather"])])
def test_ranks_train_the_single_process_adapter(tmp_path: Path, single: Path, ranks: int, extra: list[str]) -> None:
    """N ranks (and another micro-batch) end on the single process's adapter, checkpoints and metric values;
    rank 0 alone writes the folder; the rows record the exchange. The 4-rank job rolls out each epoch as one
    model group (sequence 2 with the all-gather attention × CFG 2, docs/parallel.md) and trains 4-way."""
    out = tmp_path / f"r{ranks}"
    proc = ok(torchrun(ranks, "train", f"output_dir={out}", *TINY, *extra))
    assert "first-update logp byte-equal to the rollout's: 24/24 pairs (max |ratio-1| 0)" in proc.stdout
    _same_training(out, single)
    rows = _rows(out)
    assert all(r["world_size"] == ranks and r["comm_bytes_per_update"] > 0 and r["time_comm_s"] >= 0 for r in rows)
    if "sample.parallel.sp=2" in extra:  # the rollout ran sharded: its model group exchanged rows and K/V
        assert all(r["rollout_exchanges"] > 0 for r in rows)
    # one checkpoint per epoch and one metrics row per epoch: written once, by rank 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["epoch_000000", "epoch_000001"]
    assert len(rows) == 2


@pytest.mark.slow
def test_a_rank_dying_mid_update_ends_the_job_and_one_process_resumes_it(tmp_path: Path, single: Path) -> None:
    """Rank 1 dies at its 33rd loss (epoch 1, second update: per epoch each rank runs 4 updates × 6 micro-batches):
    non-zero exit within 60 s, epoch 0's checkpoint kept; one process resumes it to the same final bytes."""
    out = tmp_path / "killed"
    t0 = time.perf_counter()
    mb2 = ["train.micro_batch=2", "train.gradient_accumulation_steps=12"]  # the resume key holds the micro-batch
    proc = torchrun(2, "train", f"output_dir={out}", *TINY, *mb2, worker=True, MMDIT_TEST_DIE_TRAIN="1:33", timeout=120)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert time.perf_counter() - t0 < 60
    assert (out / "checkpoints" / "epoch_000000").is_dir()
    assert not (out / "checkpoints" / "epoch_000001").exists() and not (out / "lora").exists()
    ok(plain("train", f"output_dir={out}", *TINY, *mb2, "resume=true"))
    _same_training(out, single)


@pytest.mark.gpu
@pytest.mark.parametrize("backend, gpus", [("nccl", 2), ("gloo", 1)])  # gloo: both ranks share one GPU, host-staged
def test_ranks_on_gpus_train_the_single_gpu_adapter(tmp_path: Path, backend: str, gpus: int) -> None:
    import torch

    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPU(s)")
    gpu = [*TINY, "model.device=cuda"]
    ok(plain("train", f"output_dir={tmp_path / 'one'}", *gpu))
    ok(torchrun(2, "train", f"output_dir={tmp_path / 'two'}", *gpu, f"distributed.backend={backend}",
                "distributed.check_state=update"))
    _same_training(tmp_path / "two", tmp_path / "one")


@pytest.mark.slow
@pytest.mark.extended  # the row owner / adapter / run parts are covered by faster tests
def test_edit_training_on_two_ranks_gives_the_single_process_adapter(tmp_path: Path) -> None:
    """experiment=grpo_edit_tiny (seeded conditioning, drawn identically on every rank) on 2 ranks: on-policy
    first update, and the single process's adapter, checkpoint and metric values."""
    edit = ["--quiet", "experiment=grpo_edit_tiny", "train.num_epochs=1", "train.save_freq=1", "train.eval_freq=1",
            "wandb.mode=disabled", "distributed.timeout_s=60"]
    one, two = tmp_path / "one", tmp_path / "two"
    ok(plain("train", f"output_dir={one}", *edit))
    proc = ok(torchrun(2, "train", f"output_dir={two}", *edit))
    assert "first-update logp byte-equal to the rollout's: 8/8 pairs (max |ratio-1| 0)" in proc.stdout
    for rel in ADAPTERS:
        assert sha(two / rel) == sha(one / rel), rel
    assert [_numbers(r) for r in _rows(two)] == [_numbers(r) for r in _rows(one)]


def test_a_rollout_layout_without_torchrun_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from mmdit_strict.cli.main import main

    assert main(["train", f"output_dir={tmp_path / 'x'}", *TINY, "sample.parallel.sp=2"]) != 0
    assert "launch with torchrun" in capsys.readouterr().err

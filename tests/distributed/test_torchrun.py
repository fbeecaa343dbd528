"""Rollout and recompute under torchrun (gloo on the CPU): the same bytes for any number of ranks.

Every job here is a real ``torchrun --standalone`` subprocess of the CLI; the tiny model with two
steps and three prompts keeps each one short on 2 cores. CI time: the single-process rollout every
comparison needs runs once per module (``single``), and ``compare``/``report`` (no model) run in-process,
so the CPU tests launch 8 processes in all.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("rank_worker.py")
SMALL = ["--quiet", "sampler.num_steps=2", "prompts.num_prompts=3", "wandb.mode=disabled", "distributed.timeout_s=60"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"  # the thread count torchrun gives its workers, for the single-process runs too
    env.update(extra)
    return env


def plain(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m mmdit_strict ARGS`` in one process (no torchrun)."""
    return subprocess.run([sys.executable, "-m", "mmdit_strict", *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def torchrun(n: int, *args: str, worker: bool = False, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node N -m mmdit_strict ARGS`` (or the test worker script)."""
    target = [str(WORKER)] if worker else ["-m", "mmdit_strict"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *target, *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=timeout)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cli(*args: str) -> int:
    """``mmdit-strict ARGS`` in this process: for the commands that build no model (compare, report)."""
    from mmdit_strict.cli.main import main

    return main(list(args))


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process's rollout of SMALL: the bytes every multi-rank rollout here is held to."""
    d1 = tmp_path_factory.mktemp("single")
    ok(plain("rollout", f"output_dir={d1}", *SMALL))
    return d1


_WORKER_ERROR = ("terminate called", "what():", "Error", "Exception", "Aborted", "Fatal Python error")


def ok(proc: subprocess.CompletedProcess, code: int = 0) -> subprocess.CompletedProcess:
    """``proc`` when it exited with ``code``; else a failure naming its output's tails and, first, the lines of its
    whole stderr that carry a worker's own error (torchrun's summary at the tail names only the signal)."""
    if proc.returncode != code:
        errors = [line for line in proc.stderr.splitlines() if any(m in line for m in _WORKER_ERROR)][:20]
        pytest.fail(f"exit {proc.returncode}\nworker errors:\n" + "\n".join(errors)
                    + f"\n--- stdout tail\n{proc.stdout[-3000:]}\n--- stderr tail\n{proc.stderr[-3000:]}")
    return proc


@pytest.mark.slow
def test_ranks_give_the_single_process_bytes(tmp_path: Path, single: Path) -> None:
    """Rollout on 2 ranks = rollout on 1 (tensor file byte-identical); a plain `run` reuses the 2-rank
    rollout (the world size is no part of the stage key) and recomputes it on 1 rank; a 1-rank rollout
    recomputed on 3 ranks (one sample each); both runs' reports are byte-identical and their recomputes
    equal in bytes and in the LoRA-gradient folds."""
    d1, d2 = single, tmp_path / "two"
    timings = {}
    t0 = time.perf_counter()
    ok(torchrun(2, "rollout", f"output_dir={d2}", *SMALL))
    timings["rollout N=2"] = time.perf_counter() - t0
    assert sha(d1 / "rollout" / "tensors.safetensors") == sha(d2 / "rollout" / "tensors.safetensors")
    assert cli("compare", str(d1 / "rollout"), str(d2 / "rollout")) == 0
    m2 = json.loads((d2 / "rollout" / "manifest.json").read_text())
    assert m2["side"]["world_size"] == 2 and m2["side"]["owner_rank"] == [0, 1, 1]
    assert sorted(p.name for p in d2.iterdir()) == sorted(p.name for p in d1.iterdir())  # rank 1 wrote nothing there

    t0 = time.perf_counter()
    run = ok(plain("-v", "run", f"output_dir={d2}", *SMALL))  # rollout 2 ranks (reused) / recompute 1 rank
    timings["run N=1 reusing"] = time.perf_counter() - t0
    assert "rollout: reusing verified artifact" in run.stderr and "byte-identical" in run.stdout
    t0 = time.perf_counter()
    ok(torchrun(3, "recompute", f"output_dir={d1}", *SMALL))  # rollout 1 rank / recompute 3 ranks
    timings["recompute N=3"] = time.perf_counter() - t0
    assert cli("report", str(d1)) == 0
    assert cli("report", str(d2)) == 0
    assert sha(d1 / "recompute" / "tensors.safetensors") == sha(d2 / "recompute" / "tensors.safetensors")
    r1 = json.loads((d1 / "recompute" / "manifest.json").read_text())["side"]
    r2 = json.loads((d2 / "recompute" / "manifest.json").read_text())["side"]
    assert r1["world_size"] == 3 and "world_size" not in r2
    assert [g["sample_order_sha256"] for g in r1["lora_grads_per_step"]] == \
           [g["sample_order_sha256"] for g in r2["lora_grads_per_step"]]
    assert json.loads((d1 / "report" / "report.json").read_text())["comparison"]["lora_grads_equal"] is not False
    print("timings (s):", {k: round(v, 1) for k, v in timings.items()})


@pytest.mark.slow
def test_drift_report_names_the_owning_ranks(tmp_path: Path) -> None:
    out = tmp_path / "fault"
    proc = torchrun(2, "run", f"output_dir={out}", "recompute.inject_fault=block1.img.mlp_down_gemm@1", *SMALL)
    assert proc.returncode != 0
    line = next(x for x in proc.stdout.splitlines() if x.startswith("DRIFT"))
    # sample 1: rollout blocks [0 | 1 2] put it on rank 1; recompute's shuffled order [1 2 0] on rank 0
    assert "first at step 1" in line and "sample 1 (rollout rank 1, recompute rank 0)" in line and "mlp_down_gemm" in line
    owners = [json.loads((out / s / "manifest.json").read_text())["side"]["owner_rank"][1] for s in ("rollout", "recompute")]
    assert owners == [1, 0]
    assert "exitcode  : 1" in proc.stderr  # rank 0 ended with the drift code (torchrun reports it)
    assert (out / "report" / "report.md").read_text().count("recompute rank 0") >= 1


@pytest.mark.slow
def test_ranks_with_different_configs_are_refused(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    proc = torchrun(2, "rollout", f"output_dir={tmp_path / 'x'}", *SMALL, worker=True,
                    MMDIT_TEST_RANK1_ARGS="sampler.num_steps=3")
    assert proc.returncode != 0
    assert "rank 1's sampler.num_steps=3 differs from rank 0's 2" in proc.stderr
    assert not (tmp_path / "x" / "rollout").exists()
    assert time.perf_counter() - t0 < 60


@pytest.mark.slow
def test_a_dead_rank_ends_the_job(tmp_path: Path, single: Path) -> None:
    """Rank 1 dies at step 1: the job exits non-zero within 60 s; its step checkpoint resumes on 1 rank."""
    t0 = time.perf_counter()
    proc = torchrun(2, "rollout", f"output_dir={tmp_path / 'x'}", *SMALL, worker=True, MMDIT_TEST_DIE="1:1", timeout=120)
    assert proc.returncode != 0
    assert time.perf_counter() - t0 < 60
    assert not (tmp_path / "x" / "rollout").exists()  # no artifact from a job that lost a rank
    # rank 0 kept step 0 (every rank's rows) in its step checkpoint: one process resumes it, same bytes
    assert (tmp_path / "x" / "rollout.partial" / "step_00000.safetensors").exists()
    resumed = ok(plain("-v", "rollout", f"output_dir={tmp_path / 'x'}", *SMALL))
    assert "resuming after step 1 of 2" in resumed.stderr
    assert sha(tmp_path / "x" / "rollout" / "tensors.safetensors") == sha(single / "rollout" / "tensors.safetensors")


@pytest.mark.gpu
@pytest.mark.parametrize("backend, gpus", [("nccl", 2), ("gloo", 1)])  # gloo: both ranks share one GPU, host-staged
def test_ranks_on_gpus_give_the_single_gpu_bytes(tmp_path: Path, backend: str, gpus: int) -> None:
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPU(s)")
    gpu = ["model.device=cuda", "sampler.num_steps=2", "prompts.num_prompts=4", "wandb.mode=disabled", "--quiet"]
    ok(torchrun(2, "run", f"output_dir={tmp_path / 'two'}", *gpu, f"distributed.backend={backend}"))
    ok(plain("run", f"output_dir={tmp_path / 'one'}", *gpu))
    for side in ("rollout", "recompute"):
        assert sha(tmp_path / "one" / side / "tensors.safetensors") == sha(tmp_path / "two" / side / "tensors.safetensors")

"""What a Flow-GRPO checkpoint at Qwen-Image size costs the training loop: written directly, or in the background.

The checkpoint of ``experiment=grpo_qwen_image`` (60 blocks, LoRA r = 64 on its 12 targets: 1,440 tensors, 424.7 M
FP32 values; with ``train.ema`` and AdamW's two moments: 6.8 GB), built on the CPU with the real AdamW state after one
step, written through ``CheckpointWriter`` as ``train`` does:

* ``direct`` (``train.async_checkpoint=false``): the loop waits for the snapshot, files, sha256s and fsyncs;
* ``background`` (default): the loop waits for the host snapshot only, then goes on while a thread writes; twice,
  since a run's later checkpoints copy into the host memory of the first one's snapshot.

While the background write runs, the main thread does one of two kinds of work, and its rate is compared with the
same work alone: ``python`` (a pure-Python loop: the worst case, it needs the interpreter lock all the time) and
``torch`` (256 x 256 FP32 matmuls: PyTorch releases the lock inside each op, as in a training loop's launches and
waits). A direct write runs first and last, the background ones between, each into a new folder (removed after). Times depend on this machine's disk and cores; they are what the loop saves here, not on the GPU host.

    python experiments/training/90d38df_async_checkpoint/measure.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from mmdit_strict.training.checkpoint_writer import CheckpointWriter

TARGETS = {"attn.to_q": (3072, 3072), "attn.to_k": (3072, 3072), "attn.to_v": (3072, 3072),
           "attn.to_out.0": (3072, 3072), "attn.add_q_proj": (3072, 3072), "attn.add_k_proj": (3072, 3072),
           "attn.add_v_proj": (3072, 3072), "attn.to_add_out": (3072, 3072), "img_mlp.net.0.proj": (3072, 12288),
           "img_mlp.net.2": (12288, 3072), "txt_mlp.net.0.proj": (3072, 12288), "txt_mlp.net.2": (12288, 3072)}
BLOCKS, RANK = 60, 64


def training_state() -> tuple[dict, dict, dict, dict]:
    names, params = [], []
    for b in range(BLOCKS):
        for t, (fan_in, fan_out) in TARGETS.items():
            for kind, shape in (("lora_A", (RANK, fan_in)), ("lora_B", (fan_out, RANK))):
                names.append(f"transformer_blocks.{b}.{t}.{kind}.default.weight")
                params.append(torch.nn.Parameter(torch.full(shape, 0.01)))
    opt = torch.optim.AdamW(params, lr=3e-4)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    for p in params:
        p.grad = None
    lora = {n: p.detach() for n, p in zip(names, params)}
    ema = {n: p.detach().clone() for n, p in zip(names, params)}
    return lora, {"optimizer": opt.state_dict()}, ema, {"epoch": 0}


def python_unit() -> None:
    s = 0
    for i in range(20000):
        s += i


def torch_unit(a: torch.Tensor = torch.rand(256, 256)) -> None:
    a @ a


def rate(unit, going) -> float:
    """Units of work per second while ``going()`` (checked between units, so the check costs next to nothing)."""
    n, t0 = 0, time.perf_counter()
    while going():
        unit()
        n += 1
    return n / (time.perf_counter() - t0)


def for_seconds(s: float):
    end = time.perf_counter() + s
    return lambda: time.perf_counter() < end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent))
    args = ap.parse_args()
    torch.set_num_threads(1)  # the main thread's matmuls on one core, the writer on the other
    lora, opt, ema, state = training_state()
    values = sum(t.numel() for t in lora.values())
    gb = sum(t.numel() * t.element_size() for d in (lora, ema) for t in d.values()) / 1e9 + \
        sum(v.numel() * v.element_size() for s in opt["optimizer"]["state"].values() for v in s.values()) / 1e9
    res: dict = {"tensors": len(lora), "lora_values": values, "checkpoint_gb": round(gb, 2), "runs": {}}
    units = {"python": python_unit, "torch": torch_unit}
    alone = {k: rate(u, for_seconds(3.0)) for k, u in units.items()}
    plan = (("direct, first", False, None, 1), ("background, main thread in Python", True, "python", 2),
            ("background, main thread in torch ops", True, "torch", 2), ("direct, last", False, None, 1))
    for label, background, work, saves in plan:
        root = Path(tempfile.mkdtemp(prefix="ckpt_measure_"))
        try:
            writer = CheckpointWriter(background=background)
            for epoch in range(saves):  # a run's later checkpoints copy into the first one's host memory
                t0 = time.perf_counter()
                writer.save(root, epoch, lora, opt, state, ema)
                row = {"loop_blocked_s": round(time.perf_counter() - t0, 2)}
                if background:
                    during = rate(units[work], lambda: writer.pending)
                    writer.wait()
                    row["write_done_after_s"] = round(time.perf_counter() - t0, 2)
                    row["main_thread_rate_vs_alone"] = round(during / alone[work], 2)
                name = label if saves == 1 else f"{label}, {'first' if epoch == 0 else 'next'} checkpoint"
                res["runs"][name] = row
                print(name, row, flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res["environment"] = {"commit": commit, "torch": torch.__version__, "python": platform.python_version(),
                          "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread, CPU only"}
    out = Path(args.out)
    (out / "measure.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = [f"# A Qwen-Image Flow-GRPO checkpoint ({len(lora)} LoRA tensors, {res['checkpoint_gb']} GB with EMA and "
             "AdamW), written directly and in the background", "",
             "| write | training loop blocked | write finished after | main thread's rate during the write |",
             "|---|---|---|---|"]
    for label, row in res["runs"].items():
        lines.append(f"| {label} | {row['loop_blocked_s']} s | {row.get('write_done_after_s', row['loop_blocked_s'])} s | "
                     f"{row.get('main_thread_rate_vs_alone', '—')} |")
    lines += ["", f"commit `{commit}`, torch {torch.__version__}, {res['environment']['machine']}"]
    (out / "measure.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""Host cost of hashing the training state at Qwen-Image size (CPU): ``state_digest`` (torchrun's check that the ranks
hold the same LoRA and AdamW bytes, at every checkpoint) and ``tensor_sha256`` of all LoRA values in one tensor (the
recompute's per-step gradient hash at this size). The LoRA is ``grpo_qwen_image``'s: 60 blocks, r = 64 on 12 targets,
1,440 FP32 tensors; AdamW's state after one step. Prints seconds and the peak growth of host memory.

    python experiments/training/8bae852_hash_copies/hash_cost.py
"""

from __future__ import annotations

import resource
import subprocess
import time

import torch

from mmdit_strict.training.state import state_digest
from mmdit_strict.trajectories.hashing import tensor_sha256


def main() -> None:
    shapes = []
    for _ in range(60):
        for fan_in, fan_out in [(3072, 3072)] * 8 + [(3072, 12288), (12288, 3072)] * 2:
            shapes += [(64, fan_in), (fan_out, 64)]
    params = [torch.nn.Parameter(torch.full(s, 0.01)) for s in shapes]
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    opt = torch.optim.AdamW(params, lr=1e-4)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    for p in params:
        p.grad = None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}, torch {torch.__version__}, {len(params)} tensors, {flat.numel() * 4 / 1e9:.2f} GB of LoRA")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(2):
        t0 = time.perf_counter()
        digest = state_digest(named, opt, sched, None)
        print(f"state_digest (LoRA + AdamW): {time.perf_counter() - t0:.2f} s, {digest[:16]}")
    t0 = time.perf_counter()
    digest = tensor_sha256(flat)
    print(f"tensor_sha256 of the LoRA as one tensor: {time.perf_counter() - t0:.2f} s, {digest[:16]}")
    print(f"peak host memory growth while hashing: {(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024:.0f} MB")


if __name__ == "__main__":
    main()

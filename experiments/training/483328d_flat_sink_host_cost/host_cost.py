"""Host cost of the streamed grad sink for one update, tensor by tensor against flat deposits (CPU, no GPU).

1,440 tensors (the default LoRA's count at 60 blocks), 64 keys (32 pairs x 2 CFG branches) in micro-batches of 4
keys, the negative branch's replay first, as the captured sequential-CFG steps hand them over; with and without
HostPark(lookahead=4). Each tensor has 64 elements, so this times the sink's Python and counts the tensor operations
it issues (each one a kernel launch or copy on CUDA; counted in a second, untimed run), not memory traffic. The per-tensor rows are what a captured
step's deposit log did before flat buffers (``DepositLog.replay`` calling ``add`` per tensor).

    python experiments/training/483328d_flat_sink_host_cost/host_cost.py [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import subprocess
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mmdit_strict.kernels.fold_park import HostPark
from mmdit_strict.kernels.grad_sink import SampleGradSink

TENSORS, NUMEL, PAIRS, MB_KEYS = 1440, 64, 32, 4


class CountOps(TorchDispatchMode):
    """Counts the ATen operations issued inside the block (views and metadata included)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.copies_and_sums = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = func.__name__
        if name.startswith(("add", "clone", "copy_", "empty", "zeros")):
            self.copies_and_sums += 1
        return func(*args, **(kwargs or {}))


def one_update(flat: bool, park: HostPark | None, count: bool) -> dict:
    params = [torch.empty(NUMEL) for _ in range(TENSORS)]
    offsets = [i * NUMEL for i in range(TENSORS)]
    keys = [(p, b) for p in range(PAIRS) for b in range(2)]
    g = torch.Generator().manual_seed(0)
    bufs = [torch.randn(TENSORS * NUMEL, generator=g) for _ in range(MB_KEYS // 2)]  # the arena: one flat per position
    views = [[b[o:o + NUMEL] for o in offsets] for b in bufs]
    sink = SampleGradSink(keys, autograd_sums=False, park=park)
    counter = CountOps()
    t0 = time.perf_counter()
    with counter if count else contextlib.nullcontext():
        for mb in range(len(keys) // MB_KEYS):
            ks = keys[MB_KEYS * mb: MB_KEYS * mb + MB_KEYS]
            for br in (1, 0):  # negative branch first
                kk = [k for k in ks if k[1] == br]
                if flat:
                    sink.add_flat(params, offsets, kk, bufs[:len(kk)])
                else:
                    for i, p in enumerate(params):
                        sink.add(p, kk, [views[pos][i] for pos in range(len(kk))])
            sink.done(ks)
        folded = [sink.fold(p) for p in params]
    wall = time.perf_counter() - t0
    return {"deposits": "flat" if flat else "per tensor", "parked": park is not None, "host_s": round(wall, 4),
            "sink_host_seconds": round(sink.stats.host_seconds, 4), "aten_ops": counter.ops,
            "copies_allocs_sums": counter.copies_and_sums, "parks": park.stats.parks if park else 0,
            "group_tensors": sink.stats.group_tensors, "folded": sum(f is not None for f in folded),
            "_fold": torch.cat([f.reshape(-1) for f in folded])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for park in (False, True):
        for flat in (False, True):
            timed = one_update(flat, HostPark(lookahead=MB_KEYS) if park else None, count=False)
            counted = one_update(flat, HostPark(lookahead=MB_KEYS) if park else None, count=True)  # slower: not timed
            timed.update({k: counted[k] for k in ("aten_ops", "copies_allocs_sums")})
            rows.append(timed)
    ref = rows[0]["_fold"]
    for r in rows:
        r["same_bytes_as_per_tensor"] = bool(torch.equal(r.pop("_fold").view(torch.int32), ref.view(torch.int32)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"commit": commit, "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread",
              "torch": torch.__version__, "tensors": TENSORS, "numel": NUMEL, "keys": 2 * PAIRS,
              "micro_batch_keys": MB_KEYS, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_cost.json").write_text(json.dumps(report, indent=2) + "\n")
    head = "| deposits | parked | host s | sink's own s | ATen ops | copies, allocations, sums | parks | tensors as one group | same bytes |"
    lines = [f"# Grad sink host cost of one update (CPU, commit {commit}, torch {torch.__version__})", "", head,
             "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['deposits']} | {'yes' if r['parked'] else 'no'} | {r['host_s']:.3f} | {r['sink_host_seconds']:.3f} | "
                     f"{r['aten_ops']:,} | {r['copies_allocs_sums']:,} | {r['parks']:,} | {r['group_tensors']} | "
                     f"{'yes' if r['same_bytes_as_per_tensor'] else 'NO'} |")
    (args.out / "host_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

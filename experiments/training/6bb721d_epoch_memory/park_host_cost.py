"""Host cost of parking on the CPU: the streamed sink over 1,440 tensors (the default LoRA's count at 60 blocks)
and 64 keys (32 pairs x 2 CFG branches) in micro-batches of 4 keys, negative branch first, with and without
HostPark(lookahead=4). Tiny tensors, so this is the Python bookkeeping alone (no copies worth timing, no CUDA).

    python experiments/training/6bb721d_epoch_memory/park_host_cost.py
"""
import time
import torch
from mmdit_strict.kernels.grad_sink import SampleGradSink
from mmdit_strict.kernels.fold_park import HostPark
params = [torch.zeros(4) for _ in range(1440)]
keys = [(p, b) for p in range(32) for b in range(2)]
part = torch.ones(4)
for park in (None, HostPark(lookahead=4)):
    sink = SampleGradSink(keys, autograd_sums=False, park=park)
    t0 = time.perf_counter()
    for mb in range(16):
        ks = keys[4 * mb: 4 * mb + 4]
        for br in (1, 0):  # the negative branch's backward first, as sequential CFG deposits
            kk = [k for k in ks if k[1] == br]
            for p in params:
                sink.add(p, kk, [part, part])
        sink.done(ks)
    for p in params:
        sink.fold(p)
    print("park" if park else "plain", f"{time.perf_counter() - t0:.2f} s", park.stats if park else "")

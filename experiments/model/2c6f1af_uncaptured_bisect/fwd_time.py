"""Time the uncaptured strict forward of the package on PYTHONPATH (bisecting a host-time regression)."""
import cProfile, dataclasses, io, json, os, pstats, sys, time
import torch
from mmdit_strict.config.arch import preset
from mmdit_strict.model.init import build_model
from mmdit_strict.bench.model import _inputs

layers = int(sys.argv[1]); prof_on = len(sys.argv) > 2
arch = dataclasses.replace(preset("qwen-image"), num_layers=layers)
model = build_model(arch, seed=0, runtime="strict", dtype=torch.bfloat16, device="cuda")
inp = _inputs(arch, (64, 64), [128], torch.bfloat16, "cuda")
def fwd():
    with torch.no_grad():
        model(**inp, return_dict=False)
for _ in range(3): fwd()
torch.cuda.synchronize()
walls, hosts = [], []
for _ in range(10):
    torch.cuda.synchronize(); t0 = time.perf_counter(); fwd(); h = time.perf_counter() - t0
    torch.cuda.synchronize(); walls.append((time.perf_counter() - t0) * 1e3); hosts.append(h * 1e3)
walls.sort(); hosts.sort()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA]) as p:
    fwd(); torch.cuda.synchronize()
ks = [e for e in p.events() if e.device_type.name == "CUDA"]
kms = sum(e.time_range.elapsed_us() for e in ks) / 1e3
res = {"commit": os.environ.get("MMDIT_COMMIT"), "layers": layers, "wall_ms": walls[5], "host_ms": hosts[5],
       "launches": len(ks), "kernel_ms": kms, "host_us_per_launch": hosts[5] * 1e3 / len(ks)}
print("RESULT", json.dumps(res))
if prof_on:
    pr = cProfile.Profile(); pr.enable()
    for _ in range(3): fwd()
    torch.cuda.synchronize(); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35); print(s.getvalue())

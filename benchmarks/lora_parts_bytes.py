"""Probe (GPU): the bytes of the LoRA layers' main-kernel launches, per epilogue column split, as SHA-256 digests.

The LoRA term of a main-kernel launch is computed per epilogue column part (each part its own FP32 accumulator over
R), so how a tile's epilogue is cut must not move a byte. This runs each LoRA layer class of the model (q/k/v and
attn_out 3072 → 3072, mlp_up 3072 → 12288 with tanh-GELU and its stored pre-activation, mlp_down 12288 → 3072) in
both GEMM streams, BF16 and FP32, at several row counts: the forward (y, pre, u) and dX, with the configured launch
and with the epilogue forced to 1, 2 and 4 parts. It writes one digest per output and reports any split that
disagrees with the configured launch. Two runs of this probe on two builds of the kernel compare with ``--compare``:

    python -m benchmarks.lora_parts_bytes --out DIR/after.json
    python -m benchmarks.lora_parts_bytes --compare DIR/before.json DIR/after.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

LAYERS = ((3072, 3072, "none"), (3072, 12288, "gelu_tanh"), (12288, 3072, "none"))  # (in, out, epilogue)
ROWS = (1, 77, 128, 300, 4224)
RANK = 64
SPLITS = (None, 1, 2, 4)  # None: the configured launch


def _digest(t) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def run() -> dict[str, str]:
    """``{case: sha256}`` over layers × dtypes × streams × rows × splits."""
    import torch

    from mmdit_strict.kernels.streams import gemm_stream
    from mmdit_strict.kernels.triton import configs as C
    from mmdit_strict.kernels.triton.gemm import launch as L

    out: dict[str, str] = {}
    for dtype in (torch.bfloat16, torch.float32):
        for k, n, epi in LAYERS:
            g = torch.Generator(device="cuda").manual_seed(k + 3 * n)
            w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(dtype)
            b = (0.1 * torch.randn(n, device="cuda", generator=g)).to(dtype)
            lora = ((torch.randn(RANK, k, device="cuda", generator=g) * k**-0.5).to(dtype),
                    (torch.randn(n, RANK, device="cuda", generator=g) * RANK**-0.5).to(dtype), 2.0)
            store = epi != "none"
            for stream in ("image", "text"):
                for m in ROWS:
                    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
                    dy = torch.randn(m, n, device="cuda", generator=g).to(dtype)
                    for split in SPLITS:
                        fwd = C.fwd_config(n, k, dtype, stream)
                        dxc = C.fwd_config(k, n, dtype, stream)
                        if split is not None:
                            fwd, dxc = fwd.replace(epi_split=split), dxc.replace(epi_split=split)
                        with gemm_stream(stream):
                            y, pre, u = L.gemm_fwd(x, w, b, epilogue=epi, store_pre=store, lora=lora, config=fwd)
                        dx = L.gemm_bwd(dy, x, w, seqlens=(m,), epilogue=epi, pre=pre, lora=lora, u=u,
                                        needs=(True, False, False, False, False), dx_config=dxc, stream=stream)[0]
                        tag = f"{str(dtype)[6:]} {k}->{n} {stream} M={m} split={split or 'configured'}"
                        for name, t in (("y", y), ("pre", pre), ("u", u), ("dX", dx)):
                            if t is not None:
                                out[f"{tag} {name}"] = _digest(t)
    return out


def split_mismatches(digests: dict[str, str]) -> list[str]:
    """Cases whose forced split gives other bytes than the configured launch of the same case."""
    bad = []
    for key, h in digests.items():
        if "split=configured" in key:
            continue
        head, _, tail = key.partition(" split=")
        ref = f"{head} split=configured {tail.split(' ', 1)[1]}"
        if digests.get(ref) != h:
            bad.append(key)
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lora_parts_bytes", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON file for the digests")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two digest files and exit")
    args = p.parse_args(argv)
    if args.compare:
        a, b = (json.loads(Path(f).read_text())["digests"] for f in args.compare)
        common = sorted(set(a) & set(b))
        moved = [c for c in common if a[c] != b[c]]
        print(f"{len(common)} outputs in both; {len(moved)} moved")
        for c in moved[:50]:
            print("  moved:", c)
        return 1 if moved or not common else 0
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.lora_parts_bytes needs a CUDA GPU")
    digests = run()
    bad = split_mismatches(digests)
    print(f"{len(digests)} outputs; {len(bad)} differ from the configured launch")
    for c in bad[:50]:
        print("  differs:", c)
    if args.out:
        Path(args.out).write_text(json.dumps({"digests": digests, "split_mismatches": bad}, indent=1, sort_keys=True))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

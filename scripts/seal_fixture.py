"""Seal the text → image fixture that tests/pipelines/test_sealed_fixture.py replays (mmdit_strict/pipelines/sealed.py).

    python scripts/seal_fixture.py            # rewrites tests/fixtures/sealed_t2i/ on this platform
    python scripts/seal_fixture.py --edit     # rewrites tests/fixtures/sealed_edit/ (tests/pipelines/test_sealed_edit.py)
    python scripts/seal_fixture.py --device cuda --out DIR          # a GPU fixture (BF16 model, Triton kernels)
    python scripts/seal_fixture.py --edit --device cuda --out DIR   # (tests/pipelines/test_sealed_gpu.py replays them)

Re-seal only on purpose (a change that is meant to move the bytes), and say so in the commit.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from mmdit_strict.pipelines.sealed import seal

ROOT = Path(__file__).resolve().parents[1]
T2I = ["prompts.text=[a red fox in the snow,a blue car at dusk]", "sampler.num_steps=4", "sampler.height=64",
       "sampler.width=64"]
# Edit: two instructions, each with its own input picture (sides 64×64 and 48×80: one batch mixes sizes),
# VAE-encoded with the fixture pipeline's VAE; 3 steps at 64².
EDIT = ["prompts.text=[make the sky red,add a small boat]", "sampler.num_steps=3", "sampler.height=64",
        "sampler.width=64", "prompts.edit.source=folder", "prompts.edit.folder={fixture}/input"]


def edit_pictures(seed: int = 0) -> dict[str, np.ndarray]:
    """Two deterministic input pictures: a colour ramp plus keyed noise, uint8 (H, W, 3)."""
    out = {}
    for k, (h, w) in enumerate(((64, 64), (48, 80))):
        g = torch.Generator().manual_seed(4_000_037 * (seed + 1) + k)
        ramp = torch.linspace(0, 200, w).view(1, w, 1).expand(h, w, 3) * torch.tensor([1.0, 0.6, 0.3])
        noise = torch.randint(0, 56, (h, w, 3), generator=g).float()
        out[f"input_{k}.png"] = (ramp + noise).clamp(0, 255).to(torch.uint8).numpy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edit", action="store_true", help="seal the edit fixture (input pictures + instructions)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: seal on this GPU (model in bfloat16, strict Triton kernels)")
    args = parser.parse_args()
    if args.edit:
        args.out = args.out or ROOT / "tests" / "fixtures" / ("sealed_edit" if args.device == "cpu" else "sealed_edit_gpu")
        record = seal(args.out, EDIT, pictures=edit_pictures(), device=args.device)
    else:
        args.out = args.out or ROOT / "tests" / "fixtures" / ("sealed_t2i" if args.device == "cpu" else "sealed_t2i_gpu")
        record = seal(args.out, T2I, device=args.device)
    print(json.dumps({"folder": str(args.out), "platform": record["platform"], "files": len(record["files"])}, indent=1))


if __name__ == "__main__":
    main()

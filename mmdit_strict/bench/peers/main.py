"""``mmdit-strict bench peers``: run the survey and write ``peers.json`` and ``peers.md``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

import torch

from .cases import FAMILIES
from .plans import PROFILES, profile
from .report import render
from .survey import ADAPTERS, NOT_RUN, check_names, survey
from .torch_det import set_cublas_workspace


def _environment(device: str) -> dict:
    from ...environment import gpu_environment, run_environment

    return gpu_environment() if device == "cuda" else run_environment(device)


def parser() -> argparse.ArgumentParser:
    """The command line of the survey."""
    ap = argparse.ArgumentParser(prog="mmdit-strict bench peers", description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for peers.json and peers.md")
    ap.add_argument("--profile", default=None, choices=PROFILES,
                    help="record set: full (the H200 run), quick (GPU smoke), tiny (CPU); default full on a GPU, tiny on the CPU")
    ap.add_argument("--quick", action="store_true", help="shorthand for --profile quick")
    ap.add_argument("--peers", default=",".join(ADAPTERS), help=f"comma list of {', '.join(ADAPTERS)} (ours always runs); "
                    f"not runnable here: {', '.join(NOT_RUN)}")
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma list of {', '.join(FAMILIES)}")
    ap.add_argument("--sections", default="invariance,accuracy,speed", help="comma list of invariance, accuracy, speed")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="skip the remaining records past this wall time")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Run the survey; exit 0 when it ran (peers failing checks are its findings, not errors), 2 on bad arguments."""
    args = parser().parse_args(argv)
    cublas = set_cublas_workspace()  # before anything touches CUDA: cuBLAS reads it when its handle is made
    peers = [p for p in args.peers.split(",") if p]
    families = [f for f in args.families.split(",") if f]
    sections = [s for s in args.sections.split(",") if s]
    check_names(peers, families)
    bad = set(sections) - {"invariance", "accuracy", "speed"}
    if bad:
        raise ValueError(f"--sections: unknown {sorted(bad)} (invariance, accuracy, speed)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    prof = profile("quick" if args.quick else args.profile or ("full" if device == "cuda" else "tiny"))
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = _environment(device)

    def flush(rep: dict) -> None:
        rep.update(env=env, cublas=cublas)
        (out / "peers.json").write_text(json.dumps(rep, indent=1))
        (out / "peers.md").write_text(render(rep))

    rep = survey(prof, families, peers, device, sections, args.budget_s, flush)
    flush(rep)
    print(f"peers report: {out / 'peers.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

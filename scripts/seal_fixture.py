"""Seal the text → image fixture that tests/pipelines/test_sealed_fixture.py replays (mmdit_strict/pipelines/sealed.py).

    python scripts/seal_fixture.py            # rewrites tests/fixtures/sealed_t2i/ on this platform

Re-seal only on purpose (a change that is meant to move the bytes), and say so in the commit.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mmdit_strict.pipelines.sealed import seal

ROOT = Path(__file__).resolve().parents[1]
T2I = ["prompts.text=[a red fox in the snow,a blue car at dusk]", "sampler.num_steps=4", "sampler.height=64",
       "sampler.width=64"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "sealed_t2i")
    args = parser.parse_args()
    record = seal(args.out, T2I)
    print(json.dumps({"folder": str(args.out), "platform": record["platform"], "files": len(record["files"])}, indent=1))


if __name__ == "__main__":
    main()

"""Regenerate the figures the README quotes from real runs of the current code.

The README holds blocks between ``<!-- readme:NAME -->`` and ``<!-- /readme:NAME -->`` markers; this
script runs the commands each block shows, on the embedded tiny default (CPU), and writes their real
output between the markers:

* ``default``: the output of ``mmdit-strict run``;
* ``fault``: the output of the planted-fault demo and its first-drift table (from ``report.json``);
* with ``--train``, also ``experiments/training/grpo_tiny_reward_curve.png`` from
  ``mmdit-strict train experiment=grpo_tiny`` (about 1.5 minutes on 2 cores) and the metrics it came from;
* with ``--ablate``, also ``ablation``: the first table of ``mmdit-strict ablate experiment=ablation_tiny``'s
  report (about 1.5 minutes on 2 cores).

``--check`` writes nothing and exits 1 when a block differs from what the runs print now. The text
figures are CPU bytes: another CPU type may print other digits (the README records the machine they
came from in ``readme_figures.json``).

    python scripts/readme_figures.py            # refresh the text blocks
    python scripts/readme_figures.py --train    # and the reward curve
    python scripts/readme_figures.py --ablate   # and the ablation table
    python scripts/readme_figures.py --check    # exit 1 when the README is stale (--check --ablate: that table too)
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PROVENANCE = REPO / "experiments" / "cpu" / "readme_figures.json"
CURVE = REPO / "experiments" / "training" / "grpo_tiny_reward_curve.png"
FAULT = "recompute.inject_fault=block1.img.mlp_down_gemm@2"
TABLE_FIELDS = ("operator", "block", "stream", "branch", "logical_row", "element")


def _cli(*argv: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "mmdit_strict", *argv, "--quiet", f"--config-dir={REPO / 'configs'}"],
                          capture_output=True, text=True, cwd=REPO)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"mmdit-strict {' '.join(argv)} failed (exit {proc.returncode}):\n{proc.stderr}")
    return proc


def _shown(text: str, out_dir: Path, shown_as: str) -> str:
    """``text`` with the temporary folder replaced by the ``output_dir`` the README's command names."""
    return text.replace(str(out_dir), shown_as).strip()


def default_block(work: Path) -> str:
    out = work / "default"
    proc = _cli("run", f"output_dir={out}")
    return "```\n" + _shown(proc.stdout, out, "runs/default") + "\n```"


def fault_block(work: Path) -> str:
    out = work / "fault"
    proc = _cli("run", FAULT, f"output_dir={out}")
    first = json.loads((out / "report" / "report.json").read_text())["localization"]["first"]
    lines = _shown(proc.stdout, out, "runs/fault").splitlines()
    table = ["| field | value |", "|---|---|", *(f"| {k} | {first[k]} |" for k in TABLE_FIELDS)]
    return "```\n" + lines[0] + "\n```\n\n" + "\n".join(table)


def ablation_block(work: Path) -> str:
    """The summary and the first table of the tiny ablation's report (entries, expectations, first drifts)."""
    out = work / "ablation"
    _cli("ablate", "experiment=ablation_tiny", f"output_dir={out}")
    parts = (out / "ablation" / "report.md").read_text().split("\n\n")
    summary = next(p for p in parts if p.startswith("**"))
    table = next(p for p in parts if p.startswith("| entry | kind |"))
    return summary + "\n\n" + table


def train_curve(work: Path) -> dict:
    out = work / "train"
    _cli("train", "experiment=grpo_tiny", f"output_dir={out}", "wandb.mode=disabled")
    CURVE.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out / "reward_curve.png", CURVE)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"command": "mmdit-strict train experiment=grpo_tiny",
            "reward_mean": [round(r["reward_mean"], 6) for r in rows]}


def replace_block(text: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- readme:{name} -->\n).*?(\n<!-- /readme:{name} -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"README.md has no <!-- readme:{name} --> … <!-- /readme:{name} --> block")
    return pattern.sub(lambda m: m.group(1) + body + m.group(2), text)


def machine() -> dict:
    import torch

    from mmdit_strict.environment import commit

    return {"commit": commit(), "cpu": platform.processor() or platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a README block is stale")
    parser.add_argument("--train", action="store_true", help="also regenerate the grpo_tiny reward curve (slow)")
    parser.add_argument("--ablate", action="store_true", help="also regenerate (or with --check, check) the tiny ablation's table")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        blocks = {"default": default_block(work), "fault": fault_block(work)}
        if args.ablate:
            blocks["ablation"] = ablation_block(work)
        train = train_curve(work) if args.train and not args.check else None
    text = README.read_text()
    new = text
    for name, body in blocks.items():
        new = replace_block(new, name, body)
    if args.check:
        stale = [n for n in blocks if replace_block(text, n, blocks[n]) != text]
        for n in stale:
            print(f"README block {n!r} is stale; now:\n{blocks[n]}")
        return 1 if stale else 0
    README.write_text(new)
    record = json.loads(PROVENANCE.read_text()) if PROVENANCE.exists() else {}
    record["text_blocks"] = {"machine": machine(), "commands": ["mmdit-strict run", f"mmdit-strict run {FAULT}"]}
    if train is not None:
        record["reward_curve"] = {"machine": machine(), **train}
    if args.ablate:
        record["ablation_table"] = {"machine": machine(), "command": "mmdit-strict ablate experiment=ablation_tiny"}
    PROVENANCE.parent.mkdir(parents=True, exist_ok=True)
    PROVENANCE.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"README.md refreshed ({', '.join(blocks)}{', reward curve' if train else ''}); provenance → {PROVENANCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

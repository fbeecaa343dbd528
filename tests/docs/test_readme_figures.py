"""The figures the README quotes come from real runs of the current code (trust row 15)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
PROVENANCE = REPO / "experiments" / "cpu" / "readme_figures.json"


@pytest.mark.slow
def test_readme_output_blocks_match_a_fresh_run() -> None:
    """`scripts/readme_figures.py --check` re-runs the README's default and planted-fault commands and
    compares their output with the README's blocks. CPU bytes are promised per machine kind only, so
    on a CPU other than the one the figures were made on the check is skipped, saying which."""
    made_on = json.loads(PROVENANCE.read_text())["text_blocks"]["machine"]
    here = {"cpu": platform.processor() or platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__}
    if any(made_on[k] != v for k, v in here.items()):
        pytest.skip(f"README figures were made on {made_on}, this machine is {here}")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "readme_figures.py"), "--check"],
                          capture_output=True, text=True, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_readme_names_every_command() -> None:
    """Every subcommand of `mmdit-strict` has a row in the README's command table."""
    from mmdit_strict.cli.main import build_parser

    table = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `")]
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    missing = [name for name in sub.choices if not any(f"`{name}" in line.split(" | ")[0] for line in table)]
    assert not missing, f"README command table lacks {missing}"

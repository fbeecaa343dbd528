"""The package's layering, as docs/design.md states it: which subpackage may import which.

Read off the source with ``ast`` (every ``import`` / ``from … import`` of the package, top level or
inside a function), so a lazy import cannot slip past it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "mmdit_strict"

#: Leaf modules and utilities every layer may use.
BASE = {"context", "dtypes", "io", "figures", "tolerances", "environment", "__init__"}

#: subpackage → the subpackages it may import (besides BASE). Operators know no model and no runs; the
#: model knows no artifacts; the references share nothing with the kernels; nothing imports the CLI.
ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "fingerprint": {"config"},
    "kernels": set(),
    "distributed": {"kernels"},
    "reference": {"config"},
    "sampling": {"kernels"},
    "model": {"config", "kernels"},
    "overlay": {"kernels", "model"},
    "parallel": {"distributed", "kernels", "model"},
    "analysis": {"config", "kernels", "model", "reference"},
    "trajectories": {"config", "distributed", "fingerprint", "kernels", "model", "overlay", "parallel", "sampling"},
    "pipelines": {"config", "kernels", "model", "sampling", "trajectories"},
    "training": {"config", "distributed", "kernels", "model", "parallel", "pipelines", "sampling", "trajectories"},
    "bench": {"analysis", "config", "kernels", "model", "reference"},
    "ablation": {"config", "overlay", "training", "trajectories"},
    "cli": {"ablation", "bench", "config", "distributed", "fingerprint", "kernels", "model", "overlay", "parallel", "pipelines", "training",
            "trajectories"},
    "__main__": {"cli"},
}

#: Single modules allowed more than their subpackage (path under mmdit_strict → the extra subpackages). The
#: benchmark of one Flow-GRPO update drives the training functions themselves, so it sits above training;
#: the rest of bench/ keeps its row above.
MODULE_EXTRA: dict[str, set[str]] = {"bench/train.py": {"sampling", "trajectories", "training"}}


def _layer(parts: tuple[str, ...]) -> str:
    return parts[0].removesuffix(".py")


def _imports(path: Path) -> set[str]:
    """The top-level subpackages of mmdit_strict that ``path`` imports."""
    parts = path.relative_to(PACKAGE).parts
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names = [node.module or ""]
            else:
                base = list(parts[:-1])[: len(parts) - node.level]
                target = base + [m for m in (node.module or "").split(".") if m]
                names = ["mmdit_strict." + ".".join(target or ["__init__"])]
                if not node.module:  # ``from .. import x``: x may be a subpackage
                    names += ["mmdit_strict." + ".".join([*base, a.name]) for a in node.names]
        else:
            continue
        for name in names:
            bits = name.split(".")
            if bits[0] == "mmdit_strict" and len(bits) > 1:
                found.add(bits[1])
            elif bits[0] == "mmdit_strict":
                found.add("__init__")
    return found


def test_every_import_follows_the_layering() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = _layer(path.relative_to(PACKAGE).parts)
        if layer in BASE:
            continue
        assert layer in ALLOWED, f"{path}: subpackage {layer!r} has no entry in the layering table"
        allowed = ALLOWED[layer] | MODULE_EXTRA.get(path.relative_to(PACKAGE).as_posix(), set())
        for target in _imports(path) - {layer} - BASE:
            if (PACKAGE / target).is_dir() or (PACKAGE / f"{target}.py").exists():
                if target not in allowed:
                    wrong.append(f"{path.relative_to(PACKAGE)} imports {target}")
    assert not wrong, "layering broken:\n" + "\n".join(wrong)


def test_base_modules_import_nothing_above_them() -> None:
    for name in sorted(BASE - {"__init__"}):
        path = PACKAGE / f"{name}.py"
        if path.exists():
            assert _imports(path) <= BASE, f"{name}.py imports {sorted(_imports(path) - BASE)}"

"""The repository's code and docs stand alone: nothing points at a contract file outside it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# assembled so this file does not match itself
OUTSIDE = ("DESIGN" + ".md", "../" + "shared/")


def test_no_file_points_outside_the_repository() -> None:
    offenders = []
    for top in ("mmdit_strict", "docs", "configs", "tests", "README.md", "pyproject.toml"):
        base = ROOT / top
        files = [base] if base.is_file() else [p for p in base.rglob("*") if p.is_file() and p.suffix in {".py", ".md", ".yaml", ".toml"}]
        for path in files:
            text = path.read_text(encoding="utf-8", errors="replace")
            offenders += [f"{path.relative_to(ROOT)}: {needle}" for needle in OUTSIDE if needle in text]
    assert not offenders, "files point outside the repository:\n" + "\n".join(offenders)


def test_design_page_has_the_sections_the_code_cites() -> None:
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    for n in range(1, 11):
        assert f"## §{n} " in text, f"docs/design.md lacks §{n}"

"""The survey's report: per family one table (implementation | records failing invariance | accuracy failures
with the worst case | speed relative to ours at small and large batch), then what each implementation is, what
could not run and why, and the environment line. JSON holds every record; the markdown is rendered from it."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .. import markdown as md
from ...environment import environment_line
from .cases import FAMILIES

COLUMNS = ("implementation", "op", "dtype", "records failing invariance", "accuracy failures (worst case)",
           "speed vs ours, small batch", "speed vs ours, large batch")


def _key(r: dict) -> tuple[str, str, str]:
    return r["op"], r["dtype"], r["name"]


def invariance_cell(rows: list[dict]) -> str:
    """``failing/checked`` over an implementation's invariance rows (or the error that stopped it)."""
    if not rows:
        return "—"
    errs = [r["error"] for r in rows if r.get("error")]
    if errs:
        return f"error: {errs[0]}"
    failing, checked = sum(r["failing"] for r in rows), sum(r["checked"] for r in rows)
    return f"**{failing}**/{checked}" if failing else f"0/{checked}"


def worst(rows: list[dict]) -> dict | None:
    """The tensor with the largest error/bound ratio over an implementation's accuracy rows, with its record."""
    best: dict | None = None
    for r in rows:
        for t in r.get("tensors", []):
            ratio = t.get("bound_ratio")
            if ratio is None:
                ratio = float("inf")
            if best is None or ratio > best["bound_ratio"]:
                best = {**t, "bound_ratio": ratio, "sizes": r.get("sizes"), "batch": r.get("batch")}
    return best


def accuracy_cell(rows: list[dict]) -> str:
    """``failing/checked`` tensors and the worst one: its error as a multiple of our bound, max abs / max|ref|, where."""
    if not rows:
        return "—"
    errs = [r["error"] for r in rows if r.get("error")]
    if errs:
        return f"error: {errs[0]}"
    failing = sum(r["failing"] for r in rows)
    checked = sum(len(r["tensors"]) for r in rows)
    w = worst(rows)
    if w is None:
        return f"{failing}/{checked}"
    rel = (w["max_abs"] / w["max_ref"]) if w.get("max_abs") is not None and w.get("max_ref") else None
    where = f"{w['tensor']} at {'+'.join(map(str, w['sizes']))} rows ×{w['batch']}"
    rel_s = f", {rel:.1e} of max\\|ref\\|" if rel is not None else ""
    head = f"**{failing}**/{checked}" if failing else f"0/{checked}"
    return f"{head} (worst {where}: {w['bound_ratio']:.2g}× bound{rel_s})"


def speed_cell(row: dict | None, ours: dict | None) -> str:
    """The peer's fwd+bwd time over ours (>1: slower than ours), then its own ms; or its error."""
    if row is None:
        return "—"
    if row.get("error"):
        return f"error: {row['error']}"
    if not ours or ours.get("error") or not ours.get("fwd_bwd_ms") or not row.get("fwd_bwd_ms"):
        return f"{row.get('fwd_bwd_ms', 0):.3f} ms"
    return f"{row['fwd_bwd_ms'] / ours['fwd_bwd_ms']:.2f}× ({row['fwd_bwd_ms']:.3f} ms; fwd {row['fwd_ms'] / ours['fwd_ms']:.2f}×)"


def family_rows(rep: dict, family: str) -> list[str]:
    """The table lines of one family: one per (op, dtype, implementation) that ran."""
    inv, acc, spd = defaultdict(list), defaultdict(list), {}
    for r in rep["invariance"]:
        if r["family"] == family:
            inv[_key(r)].append(r)
    for r in rep["accuracy"]:
        if r["family"] == family:
            acc[_key(r)].append(r)
    for r in rep["speed"]:
        if r["family"] == family:
            spd[(*_key(r), r["size"])] = r
    lines = []
    for i in rep["implementations"]:
        if i["family"] != family or "missing" in i:
            continue
        k = (i["op"], i["dtype"], i["name"])
        ours = ("ours" if i["peer"] != "ours" else None)
        cells = []
        for size in ("small", "large"):
            row = spd.get((*k, size))
            base = spd.get((i["op"], i["dtype"], "ours", size))
            cells.append("1 (ours)" if not ours and row and not row.get("error") else speed_cell(row, base))
        lines.append(md.row(i["name"], i["op"], i["dtype"], invariance_cell(inv[k]), accuracy_cell(acc[k]), *cells))
    return lines


def render(rep: dict) -> str:
    """The markdown report."""
    lines = ["# Batch-invariant peers through our qualification", "", environment_line(rep.get("env", {}),
             f"profile `{rep['profile']}`", f"CUBLAS_WORKSPACE_CONFIG `{rep.get('cublas', {}).get('CUBLAS_WORKSPACE_CONFIG', 'unset')}`"
             + ("" if rep.get("cublas", {}).get("set_before_cuda_init", True) else " (set after CUDA init: not in effect)")), "",
             "Every implementation runs the same checks as ours: raw-byte invariance (each compared sample's forward output and "
             "per-sample gradients in a batch vs the sample alone, the probe first/middle/last, companions padded longer; "
             "`torch.equal` of the bytes), accuracy of the forward and every gradient against the FP64 reference under "
             "`tolerances.yaml` (worst case = largest error as a multiple of our bound; ≤ 1 passes), and forward+backward "
             "time relative to ours in the same run (> 1: slower than ours).", ""]
    for fam in FAMILIES:
        if fam in rep["families"]:
            lines += md.section(f"{fam}", COLUMNS, family_rows(rep, fam))
    impl_lines = [md.row(i["family"], i["op"], i["dtype"], i["name"], i.get("note") or f"not run: {i['missing']}")
                  for i in rep["implementations"]]
    lines += md.section("What runs", ("family", "op", "dtype", "implementation", "what / why not"), impl_lines)
    lines += ["## Not run here", ""] + [f"- **{k}**: {v}" for k, v in rep.get("not_run", {}).items()] + [""]
    return "\n".join(lines + md.errors_and_wall_time(rep)) + "\n"

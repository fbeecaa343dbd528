"""Did a GEMM change move any bytes? Compare the accuracy rows of two ``gemm_report.json`` files.

    python -m benchmarks.gemm_report_diff OLD.json NEW.json

The qualification's inputs are seeded, so two runs of the same engine on the same kind of machine give
the same error figures to the last bit. Per accuracy row (layer, dtype, seqlens, LoRA rank, check) this
prints whether cuBLAS's figures (``torch_max_abs``, ``torch_rel_fro``) are reproduced — i.e. the inputs
and the FP64 reference are the same — and whether the engine's (``kernel_max_abs``, ``kernel_rel_fro``)
are. The Frobenius error sums every element, so a single changed element changes it. Exit status 1
when a row with a reproduced reference has different engine figures.
"""

from __future__ import annotations

import json
import sys


def _key(row: dict) -> tuple:
    return (row["layer"], row["dtype"], row["seqlens"], row["lora_r"], row["check"])


def diff_accuracy(old: dict, new: dict) -> dict:
    """Rows of ``new`` matched to ``old``: counts and the rows whose engine figures moved."""
    before = {_key(r): r for r in old.get("accuracy", [])}
    out = {"matched": 0, "reference_reproduced": 0, "engine_identical": 0, "moved": [], "unmatched": []}
    for row in new.get("accuracy", []):
        ref = before.get(_key(row))
        if ref is None:
            out["unmatched"].append(_key(row))
            continue
        out["matched"] += 1
        if (ref["torch_max_abs"], ref["torch_rel_fro"]) != (row["torch_max_abs"], row["torch_rel_fro"]):
            continue
        out["reference_reproduced"] += 1
        if (ref["kernel_max_abs"], ref["kernel_rel_fro"]) == (row["kernel_max_abs"], row["kernel_rel_fro"]):
            out["engine_identical"] += 1
        else:
            out["moved"].append(_key(row))
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit("usage: python -m benchmarks.gemm_report_diff OLD.json NEW.json")
    with open(args[0]) as f_old, open(args[1]) as f_new:
        d = diff_accuracy(json.load(f_old), json.load(f_new))
    print(f"{d['matched']} rows matched, {d['reference_reproduced']} with the reference reproduced, "
          f"{d['engine_identical']} with identical engine figures; moved: {d['moved'] or 'none'}; "
          f"unmatched: {len(d['unmatched'])}")
    return 1 if d["moved"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

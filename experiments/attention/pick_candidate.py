"""Pick the override to qualify from a candidates report (used inside one GPU call).

    python3 experiments/attention/pick_candidate.py [--any-bytes] CAND_REPORT_JSON [FALLBACK_JSON]

Prints, as one JSON object, the bf16 override with the highest forward TFLOP/s among the candidate rows that
kept the frozen forward and backward bytes and beat the frozen row; when none did, FALLBACK_JSON (default the
first non-frozen row's override) so that the qualification still runs and is reported. Rows that change the
tiles (new bytes) are never picked: they need a qualification of their own. ``--any-bytes`` is that
qualification's pick: the fastest row that beat the frozen one whether or not it kept the bytes (e.g. a
64-key-step forward tile; the qualification's accuracy and invariance sections then judge the new bytes).
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    any_bytes = "--any-bytes" in argv
    argv = [a for a in argv if a != "--any-bytes"]
    rows = json.loads(open(argv[0]).read())["candidates"]
    frozen = next((r for r in rows if r.get("config") == "frozen" and "error" not in r), None)
    same = [r for r in rows if r.get("config") != "frozen" and "error" not in r
            and (any_bytes or (r.get("fwd_bytes_equal_frozen") and r.get("bwd_bytes_equal_frozen")))]
    best = max(same, key=lambda r: r["fwd_tflops"], default=None)
    if best is not None and (frozen is None or best["fwd_tflops"] > frozen["fwd_tflops"]):
        pick = best["config"]
        why = f"fwd {best['fwd_tflops']:.0f} vs frozen {frozen['fwd_tflops'] if frozen else float('nan'):.0f} TFLOP/s"
    else:
        pick = json.loads(argv[1]) if len(argv) > 1 else next(r["config"] for r in rows if r.get("config") != "frozen")
        why = f"no {'' if any_bytes else 'byte-equal '}row beat the frozen one: fallback"
    print(f"picked {pick} ({why})", file=sys.stderr)
    print(json.dumps(pick))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""benchmarks.attention_sass: the SASS counting and loop finding on a hand-written listing (no Triton wheel needed)."""

from __future__ import annotations

from benchmarks.attention_sass import _counts, _loop_bodies


def _listing(ops: list[str]) -> str:
    return "\n".join(f"        /*{16 * i:04x}*/                   {op} ;" for i, op in enumerate(ops))


def test_counts_and_innermost_loop() -> None:
    body = ["LDSM.16.M88.4 R4, [R2]", "HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], RZ", "WARPGROUP.ARRIVE",
            "MUFU.EX2 R5, R6", "@P0 STL [R1], R3", "LDL R3, [R1]"] + ["FADD R7, R7, R8"] * 120
    ops = ["MOV R1, c[0x0][0x28]"] + body + ["@P1 BRA 0x10", "LDG.E.128 R8, desc[UR6][R2.64]", "EXIT"]
    sass = _listing(ops)
    counts = _counts(sass)
    assert counts["LDSM"] == 1 and counts["HGMMA"] == 1 and counts["WARPGROUP"] == 1 and counts["MUFU.EX2"] == 1
    assert counts["STL"] == 1 and counts["LDL"] == 1 and counts["LDG.E.128"] == 1 and counts["LDGSTS"] == 0
    (loop,) = _loop_bodies(sass)
    assert len(loop) == len(body) + 1 and loop[0].startswith("LDSM") and loop[-1] == "BRA"
    assert _loop_bodies(_listing(["NOP"] * 5 + ["BRA 0x0"])) == []  # a short loop is not a per-tile body

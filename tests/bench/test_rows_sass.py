"""benchmarks.rows_sass: SASS counting, main-loop finding and tt.reduce layouts on hand-written text (no Triton wheel)."""

from __future__ import annotations

from benchmarks.rows_sass import _counts, _instructions, _main_loop, _reduces


def _listing(ops: list[str]) -> str:
    return "\n".join(f"        /*{16 * i:04x}*/                   {op} ;" for i, op in enumerate(ops))


def test_main_loop_counts() -> None:
    inner = ["BAR.SYNC.DEFER_BLOCKING 0x0", "SHFL.BFLY PT, R3, R2, 0x1, 0x1f", "STS [R4], R3", "LDS R5, [R4]",
             "@!P0 LDG.E.128 R8, desc[UR6][R2.64]"]
    ops = ["MOV R1, c[0x0][0x28]", "@P2 STL [R1], R3"] + inner + ["@P1 BRA 0x20", "LDL R3, [R1]", "NOP", "BRA 0xa0", "EXIT"]
    ins = _instructions(_listing(ops))
    loop = _main_loop(ins)
    assert loop[0].startswith("BAR") and loop[-1] == "BRA" and len(loop) == len(inner) + 1  # "BRA 0xa0" jumps to itself only
    c = _counts(loop)
    assert (c["BAR"], c["SHFL"], c["STS"], c["LDS"], c["LDG"], c["STL"], c["LDL"]) == (1, 1, 1, 1, 1, 0, 0)
    whole = _counts([o for _, o, _ in ins])
    assert (whole["STL"], whole["LDL"]) == (1, 1)


def test_reduce_layouts() -> None:
    ttgir = "\n".join([
        "#blocked = #ttg.blocked<{sizePerThread = [8], threadsPerWarp = [32], warpsPerCTA = [8], order = [0]}>",
        '    %5:2 = "tt.reduce"(%3, %4) <{axis = 0 : i32}> ({',
        "    ^bb0(%a: f32, %b: f32, %c: f32, %d: f32):",
        "      tt.reduce.return %a, %b : f32, f32",
        "    }) : (tensor<4096xf32, #blocked>, tensor<4096xf32, #blocked>) -> (f32, f32)",
    ])
    ((axis, operands, layout),) = _reduces(ttgir)
    assert (axis, operands) == (0, 2) and layout == "blocked<{sizePerThread = [8], threadsPerWarp = [32], warpsPerCTA = [8], order = [0]}>"

#!/usr/bin/env bash
# The K-split (row-parallel TP) arithmetic measured in one GPU call (budget about 2 minutes, most of it Triton
# compiles): attention output and MLP down at M = 4224 and 256, t = 1, 2, 4, 8, BF16 then FP32 — speed against
# cuBLAS and the unsplit strict GEMM, accuracy against FP64, bytes against the unsplit GEMM and the t rank shares,
# raw-byte batch invariance, and the computed communication of both TP formulations (mmdit_strict.bench.ksplit).
# KSPLIT_ARGS adds arguments (e.g. '--dtypes bf16'); KSPLIT_S is the wall limit of the Python call (default 150).
# Run from the repository root on the GPU machine:  MMDIT_COMMIT=<hash> bash benchmarks/h200/ksplit_evidence.sh OUT_DIR
# OUT_DIR/ksplit.{json,md} is the report; OUT_DIR/ksplit_evidence.tgz holds it with the log.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/evidence_common.sh"
evidence_begin ksplit_evidence "${1:-}"
{
  evidence_header
  time timeout -s INT "${KSPLIT_S:-150}" python3 -m mmdit_strict.bench.ksplit --out "$ev" --budget-s 110 ${KSPLIT_ARGS:-}
  echo "ksplit bench exit $?"
} 2>&1 | tee "$ev/log.txt"
cp "$ev/ksplit.json" "$ev/ksplit.md" "$out/" 2>/dev/null || echo "no report was written (see the log)" >&2
evidence_pack

#!/usr/bin/env bash
# The GEMM engine's qualification on the model's classes, in one GPU call (about 4 minutes): the invariance
# section on its own first (bench.gemm always runs speed before invariance, and a time budget cut at
# acf771d stopped it inside speed), then accuracy and speed, bf16 and fp32.
# Run from the repository root on the GPU machine:  MMDIT_COMMIT=<hash> bash benchmarks/h200/gemm_evidence.sh OUT_DIR
# Everything lands in OUT_DIR/gemm_evidence.tgz.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/evidence_common.sh"
evidence_begin gemm_evidence "${1:-}"
{
  evidence_header
  evidence_run python3 -m mmdit_strict.bench.gemm --out "$ev/invariance" --sections invariance --budget-s 200
  evidence_run python3 -m mmdit_strict.bench.gemm --out "$ev/speed_accuracy" --sections speed,accuracy --budget-s 300
} 2>&1 | tee "$ev/log.txt"
evidence_pack

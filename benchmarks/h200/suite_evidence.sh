#!/usr/bin/env bash
# The test suite and the GEMM engine's qualification of one commit, in one GPU call (about 6 minutes):
#   1. the whole suite with the GPU present (`-m "gpu or not gpu"`: the CPU tests and the GPU tests),
#      spread over 8 processes with pytest-xdist;
#   2. `bench.gemm` speed and invariance sections on the model's GEMM classes, bf16 and fp32.
# Run from the repository root on the GPU machine:  MMDIT_COMMIT=<hash> bash benchmarks/h200/suite_evidence.sh OUT_DIR
# Everything lands in OUT_DIR/suite_evidence.tgz.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/evidence_common.sh"
evidence_begin suite_evidence "${1:-}"
{
  evidence_header
  time timeout 330 python3 -m pytest -q -n 8 -m "gpu or not gpu" -p no:cacheprovider -rfE >"$ev/pytest.txt" 2>&1
  echo "pytest exit $?"; tail -40 "$ev/pytest.txt"
  time python3 -m mmdit_strict.bench.gemm --out "$ev/gemm" --sections speed,invariance --budget-s 200
} 2>&1 | tee "$ev/log.txt"
evidence_pack

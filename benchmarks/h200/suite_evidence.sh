#!/usr/bin/env bash
# The whole test suite of one commit with the GPU present, in one GPU call: `-m "gpu or not gpu"` (the CPU
# tests and the GPU tests) over 16 pytest-xdist processes, with the 30 slowest tests listed. At acf771d two
# such runs reached 82 % in 230 s and 93 % in 400 s with no failure, so give it the call's whole 10 minutes.
# Run from the repository root on the GPU machine:  MMDIT_COMMIT=<hash> bash benchmarks/h200/suite_evidence.sh OUT_DIR
# Everything lands in OUT_DIR/suite_evidence.tgz.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/evidence_common.sh"
evidence_begin suite_evidence "${1:-}"
{
  evidence_header
  time timeout "${SUITE_TIMEOUT_S:-540}" python3 -m pytest -q -n 16 -m "gpu or not gpu" -p no:cacheprovider -rfE \
    --durations=30 >"$ev/pytest.txt" 2>&1
  echo "pytest exit $?"; tail -60 "$ev/pytest.txt"
} 2>&1 | tee "$ev/log.txt"
evidence_pack

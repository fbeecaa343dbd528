#!/usr/bin/env bash
# The whole test suite of one commit with the GPU present, in one GPU call: the CPU tests (`-m "not gpu"`) over
# 14 pytest-xdist processes of 2 threads each (8 before 68822d9), then the GPU tests (`-m gpu`) over 4, with skip reasons and the
# slowest durations listed. Together they are `-m "gpu or not gpu"`. Each part runs under its own limit,
# interrupted with SIGINT (pytest then prints the summary and durations of what finished). At 8a2787d the CPU
# part over 12 processes with torch's default threads (16 each, on 16 cores) ran 633 of its tests in 150 s:
# oversubscribed, its slowest tests took 2-10x their time on the 2-core CI machine.
# At 78a71e0 on an H200 the CPU part reached 1,027 of its 1,184 tests' results in 200 s (the rest cut); the GPU part
# took 163 s. SUITE_CPU_S / SUITE_GPU_S set the limits, SUITE_CPU_WORKERS the CPU part's processes (2 threads each).
# At 68822d9 on an H100, 14 workers reached 1,230 of the CPU part's 1,239 tests in 270 s: give it 300 s or more.
# Run from the repository root on the GPU machine:  MMDIT_COMMIT=<hash> bash benchmarks/h200/suite_evidence.sh OUT_DIR
# Everything lands in OUT_DIR/suite_evidence.tgz.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/evidence_common.sh"
evidence_begin suite_evidence "${1:-}"
evidence_wheels  # the suite imports omegaconf, wandb and diffusers, which the GPU image lacks
suite_part() {  # NAME LIMIT_S WORKERS MARK
  time OMP_NUM_THREADS=2 timeout -s INT "$2" python3 -m pytest -q -n "$3" -m "$4" -p no:cacheprovider -rfEs \
    --durations=40 >"$ev/pytest_$1.txt" 2>&1
  echo "pytest $1 exit $?"; grep -E "passed|failed|error" "$ev/pytest_$1.txt" | tail -3
}
{
  evidence_header
  suite_part cpu "${SUITE_CPU_S:-300}" "${SUITE_CPU_WORKERS:-14}" "not gpu"
  if [ "${SUITE_GPU_S:-360}" != 0 ]; then  # SUITE_GPU_S=0: the CPU part only
    suite_part gpu "${SUITE_GPU_S:-360}" 4 "gpu"
    tail -60 "$ev/pytest_gpu.txt"
  fi
} 2>&1 | tee "$ev/log.txt"
evidence_pack

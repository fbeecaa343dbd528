#!/usr/bin/env bash
# Issue 32's GPU bar in one GPU call: `ablate experiment=ablation_qwen_image` (Qwen-Image architecture cut to
# 4 blocks, random BF16 weights, 1024², every probe, control and runtime combination of configs/ablation/standard.yaml),
# then the GPU tests (`-m gpu`). The ablation's report, status table and plots land in OUT_DIR/ablation_evidence.tgz.
# ABLATE_ARGS adds overrides (e.g. 'ablation.only=[planted_fault]'); GPU_TESTS=0 skips the tests.
# Run from the repository root on the GPU machine:  MMDIT_COMMIT=<hash> bash benchmarks/h200/ablation_evidence.sh OUT_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/evidence_common.sh"
evidence_begin ablation_evidence "${1:-}"
{
  evidence_header
  time timeout -s INT "${ABLATE_S:-420}" python3 -m mmdit_strict ablate experiment=ablation_qwen_image \
    output_dir="$work/ablation_qwen_image" progress=false ${ABLATE_ARGS:-}; echo "ablate exit $?"
  cp -r "$work/ablation_qwen_image/ablation" "$ev/report"
  cp "$work/ablation_qwen_image/ablation.yaml" "$ev/"
  if [ "${GPU_TESTS:-1}" = 1 ]; then
    time OMP_NUM_THREADS=2 timeout -s INT "${SUITE_GPU_S:-200}" python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfEs \
      --durations=20 >"$ev/pytest_gpu.txt" 2>&1
    echo "pytest gpu exit $?"; grep -E "passed|failed|error" "$ev/pytest_gpu.txt" | tail -3
  fi
} 2>&1 | tee "$ev/log.txt"
evidence_pack

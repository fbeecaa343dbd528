#!/usr/bin/env bash
# Issue 33's GPU bar for edit conditioning in one GPU call: `run experiment=gpu_edit_job` (Qwen-Image architecture
# cut to 4 blocks, random BF16 weights, 1024² output + 1024² input image per sample, the last 1024×768, 4 steps,
# CFG 4: must print byte-identical and exit 0), then the same job with a fault planted in a conditioning-token row
# (packed row 4096 + 10 of block 0's image MLP output at step 1: must exit 1 and name the conditioning image), then
# the edit tests. Reports, manifests and logs land in OUT_DIR/edit_evidence.tgz. EDIT_ARGS adds overrides to both runs
# (e.g. 'model.num_layers=60'); TESTS=0 skips the tests.
# Run from the repository root on the GPU machine:  MMDIT_COMMIT=<hash> bash benchmarks/h200/edit_evidence.sh OUT_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/evidence_common.sh"
evidence_begin edit_evidence "${1:-}"
{
  evidence_header
  for job in clean fault; do
    extra=""
    [ "$job" = fault ] && extra="recompute.inject_fault=block0.img.mlp_down_gemm#4106@1"
    time timeout -s INT "${EDIT_S:-240}" python3 -m mmdit_strict run experiment=gpu_edit_job \
      output_dir="$work/$job" progress=false wandb.mode=disabled $extra ${EDIT_ARGS:-}; echo "edit $job exit $? (expected: clean 0, fault 1)"
    mkdir -p "$ev/$job"
    cp -r "$work/$job/report" "$ev/$job/" 2>/dev/null
    cp "$work/$job/config.yaml" "$ev/$job/" 2>/dev/null
    for side in rollout recompute; do cp "$work/$job/$side/manifest.json" "$ev/$job/${side}_manifest.json" 2>/dev/null; done
  done
  if [ "${TESTS:-1}" = 1 ]; then
    time OMP_NUM_THREADS=2 timeout -s INT "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -rfEs \
      tests/model/test_edit_conditioning.py tests/trajectories/test_edit_run.py tests/pipelines/test_sealed_edit.py \
      >"$ev/pytest_edit.txt" 2>&1
    echo "pytest edit exit $?"; grep -E "passed|failed|error" "$ev/pytest_edit.txt" | tail -3
  fi
} 2>&1 | tee "$ev/log.txt"
evidence_pack

#!/usr/bin/env bash
# The whole-model evidence of one commit, in one GPU call (about 7 minutes on an H200):
#   1. `bench.model`: strict vs diffusers eager on identical weights, 60 blocks, 1024² (B = 1, B = 2 CFG,
#      LoRA fwd + bwd with checkpointing), time / peak memory / MFU / syncs / launches;
#   2. `bench.model_qualify`: raw-byte checks at 1024², 1328², 1664×928 and the per-block error curve;
#   3. the 60-block main job (`experiment=gpu_main_job`) with the diffusers-eager peer loop.
# Run from the repository root on the GPU machine, with the project importable:
#   MMDIT_COMMIT=<hash> bash benchmarks/h200/model_evidence.sh OUT_DIR
# Everything lands in OUT_DIR/model_evidence.tgz (one file: device transfers limit the file count).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/evidence_common.sh"
evidence_begin model_evidence "${1:-}"
{
  evidence_header
  evidence_run python3 -m mmdit_strict.bench.model --out "$ev/bench" --layers 60 --reps 3 --warmup 1
  evidence_run python3 -m mmdit_strict.bench.model_qualify --out "$ev/qualify" --block-error-layers 4 --quiet
  evidence_run python3 -m mmdit_strict run experiment=gpu_main_job output_dir="$work/run" progress=false wandb.mode=disabled
  echo "main job exit $?"
  cp -r "$work/run/report" "$ev/main_job"
} 2>&1 | tee "$ev/log.txt"
evidence_pack

#!/usr/bin/env bash
# The training step's speed bars in one GPU call (more than 10 minutes on an H200 at 5f75022: give parts 2-3 a call of
# their own if the limit is 600 s; the .tgz is repacked after each part, so a cut call keeps the finished ones):
#   1. `bench.model` on the 60-block Qwen-Image at 1024²: the B = 1 forward, the LoRA r = 64 forward + backward with
#      checkpointing at B = 1 and at B = 2 with CFG; ours uncaptured and captured against diffusers eager and
#      diffusers with each block under torch.compile (its compiles run in the warm-up, not timed);
#   2. `bench.step_profile` on 2 blocks: the captured step's kernel time by (kernel, launch grid);
#   3. `bench.host_profile` on 8 blocks: the uncaptured forward's and step's host time by stack layer and function.
# diffusers is not in the GPU image: carry its wheels in .whl/. Run from the repository root on the GPU machine:
#   MMDIT_COMMIT=<hash> bash benchmarks/h200/step_evidence.sh OUT_DIR
# OUT_DIR/step_evidence.tgz holds model_bench.{json,md}, step_profile.{json,md}, host_profile.{json,md} and the log.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/evidence_common.sh"
evidence_begin step_evidence "${1:-}"
evidence_wheels
{
  evidence_header
  evidence_run python3 -m mmdit_strict.bench.model --out "$ev" --layers 60 --reps 3 --warmup 1 --runtimes strict \
    --cases fwd_b1 fwd_bwd_lora fwd_bwd_lora_b2_cfg --diffusers-compile
  evidence_run python3 -m mmdit_strict.bench.step_profile --out "$ev" --layers 2
  evidence_run python3 -m mmdit_strict.bench.host_profile --out "$ev" --layers 8
} 2>&1 | tee "$ev/log.txt"
evidence_pack

#!/usr/bin/env bash
# The training step's speed bars (more than 10 minutes on an H200 at 5f75022 for all three parts: with a 600 s call
# limit run them as two calls through STEP_PARTS; the .tgz is repacked after each part, so a cut call keeps the
# finished ones):
#   1. `bench.model` on the 60-block Qwen-Image at 1024²: the B = 1 forward, the LoRA r = 64 forward + backward with
#      checkpointing at B = 1 and at B = 2 with CFG; ours uncaptured and captured against diffusers eager and
#      diffusers with each block under torch.compile (its compiles run in the warm-up, not timed); the forward also
#      with the GEMM's gated-residual epilogue (ours_strict_graph_gated, off in the model by default), the training
#      step also with the grad sink as train runs it (ours_strict_graph_sink);
#   2. `bench.step_profile` on 2 blocks: the captured step's kernel time by (kernel, launch grid);
#   3. `bench.host_profile` on 8 blocks: the uncaptured forward's and step's host time by stack layer and function;
#   4. (`epoch_shapes`, not in the default) `bench.step_profile` on 2 blocks at the shapes of the 1024² epoch's phases:
#      a training micro-batch of one pair with CFG batched (B = 2, 64 prompt tokens) in shapes_train_b2/, and a
#      rollout step's no-grad forward of one CFG branch of a group (B = 8) in shapes_rollout_b8/. Run at 38b3d8a on an
#      H100 as two plain commands (23 s and 18 s): through this script each step_profile hung after its report until
#      step_profile stopped tearing CUPTI down (experiments/training/38b3d8a_epoch_shapes_profile_h100/).
# diffusers is not in the GPU image: carry its wheels in .whl/. Run from the repository root on the GPU machine:
#   MMDIT_COMMIT=<hash> [STEP_PARTS="model profile host epoch_shapes"] bash benchmarks/h200/step_evidence.sh OUT_DIR
# STEP_PARTS picks the parts (default all three; at 5f75022 parts 1 and 2 fitted one 580 s call, part 3 was cut).
# OUT_DIR/step_evidence.tgz holds model_bench.{json,md}, step_profile.{json,md}, host_profile.{json,md} and the log.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/evidence_common.sh"
evidence_begin step_evidence "${1:-}"
evidence_wheels
parts=" ${STEP_PARTS:-model profile host} "
{
  evidence_header
  echo "parts:$parts"
  [[ $parts == *" model "* ]] && evidence_run python3 -m mmdit_strict.bench.model --out "$ev" --layers 60 --reps 3 \
    --warmup 1 --runtimes strict --cases fwd_b1 fwd_bwd_lora fwd_bwd_lora_b2_cfg --diffusers-compile --gated-epilogue \
    --grad-sink
  [[ $parts == *" profile "* ]] && evidence_run python3 -m mmdit_strict.bench.step_profile --out "$ev" --layers 2
  [[ $parts == *" host "* ]] && evidence_run python3 -m mmdit_strict.bench.host_profile --out "$ev" --layers 8
  if [[ $parts == *" epoch_shapes "* ]]; then
    evidence_run python3 -m mmdit_strict.bench.step_profile --out "$ev/shapes_train_b2" --layers 2 --txt 64 --batch 2
    evidence_run python3 -m mmdit_strict.bench.step_profile --out "$ev/shapes_rollout_b8" --layers 2 --txt 64 \
      --batch 8 --forward-only
  fi
  true
} 2>&1 | tee "$ev/log.txt"
evidence_pack

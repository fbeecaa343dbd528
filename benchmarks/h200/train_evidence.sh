#!/usr/bin/env bash
# One Flow-GRPO update, ours vs diffusers + PEFT, in one GPU call (estimated at about 4 minutes on an H200; not yet timed):
#   `bench.train` on the 60-block Qwen-Image at 1024² (grid 64×64, 128 prompt tokens, random BF16 weights held once
#   for both engines), LoRA rank 64 on bench.model's targets, gradient checkpointing, CFG 4 in the sequential layout.
#   Sizes: G = 2 samples, S = 10 steps, SDE window W = 2 (4 pairs), micro-batches of 2 pairs. Per engine that is one
#   untimed warm-up update (Triton compiles, CUDA-graph captures, cuBLAS heuristics), the timed update and the
#   profiled update: 3 × (20 CFG forwards of 2 samples + 4 training forwards / backwards of 2 samples). A larger
#   group or window multiplies the train phase and would not fit the call.
# TRAIN_SHAPE=epoch instead times one epoch of `experiment=grpo_qwen_image` (512², grid 32×32, 2 prompts of up to 64
#   tokens × G = 8, S = 10, W = 2: 32 pairs in micro-batches of 2); every update draws fresh prompt lengths, so the timed
#   one captures its own batch layouts as an epoch of `train` does, after a warm-up update that compiled the kernels
#   (estimated at 6–8 minutes for both engines; not yet timed). TRAIN_SHAPE=epoch1024: that epoch at 1024² (grid 64×64),
#   the size the issue's epoch bar names; run each engine in its own process (on an H100 at 6ee43b4, each with its
#   warm-up: the peer 273 s, ours 185-205 s): TRAIN_ENGINES below does that and the merge in one call for the peer
#   and one engine of ours; a third engine needs a second call (TRAIN_EXTRA="--no-profile --engines X", the same other
#   options) on the same warm machine, joined with `python -m mmdit_strict.bench.train --merge`. The timed update
#   draws the same prompts whatever --warmup; keep the warm-up for the peer as well: without one its timed update is
#   its first (cold, and without the optimizer's states, so its peak memory is short of them).
# diffusers is not in the GPU image: carry its wheels (and any missing dependency) in .whl/; they are installed
# into /tmp/site without network. Run from the repository root on the GPU machine:
#   MMDIT_COMMIT=<hash> [TRAIN_EXTRA="--no-profile ..."] bash benchmarks/h200/train_evidence.sh OUT_DIR
# (OUT_DIR: $OUT on the device machine; TRAIN_EXTRA: more bench.train options, e.g. --no-profile to skip the
# profiled updates, which took 4x the timed one for the peer at 7345138, or --engines / --graph-pools; for ours' memory:
# "--engines diffusers_peft ours ours_parked --ours-micro-batch 1 --ours-cfg-layout batched --fold-batches")
# TRAIN_ENGINES="diffusers_peft ours_parked" (any engines, in order): one process per engine, each with the same
#   options, then `bench.train --merge` of their reports into the report below (each engine's own report and log are in
#   the .tgz, under runs/ENGINE/). At 1024² the peer and one engine of ours fit one 600 s call: at 78a71e0 on an H200,
#   with ours' memory-lean options, the call took 510 s (the peer's process 273 s, ours_parked's 208 s).
# OUT_DIR/train_bench.json, .md and .png are the report; OUT_DIR/train_evidence.tgz holds them with the log.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/evidence_common.sh"
evidence_begin train_evidence "${1:-}"
evidence_wheels
python3 -c 'import diffusers, peft' || { echo "diffusers or peft is not importable: carry the wheels in .whl/" >&2; exit 2; }
bench() {  # OUT_FOLDER [more options]: one bench.train process of the chosen shape
  local dest=$1; shift
  local shape=(--grid 64 64 --txt 128 --group 2)  # one update
  case ${TRAIN_SHAPE:-update} in
    epoch) shape=(--grid 32 32 --txt 64 --prompts 2 --fresh-prompts --group 8) ;;
    epoch1024) shape=(--grid 64 64 --txt 64 --prompts 2 --fresh-prompts --group 8) ;;
  esac
  # shellcheck disable=SC2086  # TRAIN_EXTRA is words
  time python3 -m mmdit_strict.bench.train --out "$dest" --device cuda --arch qwen-image --layers 60 "${shape[@]}" \
    --steps 10 --window 2 --micro-batch 2 --lora-rank 64 --warmup 1 ${TRAIN_EXTRA:-} "$@"
}
{
  evidence_header
  if [[ -n ${TRAIN_ENGINES:-} ]]; then
    reports=()
    for engine in $TRAIN_ENGINES; do
      mkdir -p "$ev/runs/$engine"
      bench "$ev/runs/$engine" --engines "$engine" 2>&1 | tee "$ev/runs/$engine/log.txt"
      evidence_pack  # a call cut by its limit still returns the engines that finished
      reports+=("$ev/runs/$engine/train_bench.json")
    done
    python3 -m mmdit_strict.bench.train --merge "${reports[@]}" --out "$ev"
  else
    bench "$ev"
  fi
} 2>&1 | tee "$ev/log.txt"
cp "$ev/train_bench.png" "$out/" 2>/dev/null  # none when no engine has timings
cp "$ev/train_bench.json" "$ev/train_bench.md" "$out/" 2>/dev/null || echo "no report was written (see the log)" >&2
evidence_pack

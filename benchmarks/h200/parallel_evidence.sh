#!/usr/bin/env bash
# Issue 31's GPU bar in one GPU call: the model-parallel layouts (sp2, sp4, cfg2, sp2×cfg2, tp2, tp4, tp2×sp2, tp2×cfg2) against one rank on the
# Qwen-Image architecture cut to 4 blocks, 1024² (64×64 latent tokens), batch 2 with CFG, random BF16 weights and
# LoRA r=16, with 4 ranks sharing the one GPU through host-staged gloo (python -m mmdit_strict.trajectories.layout_check).
# OUT_DIR/parallel_check.{json,md} is the report; OUT_DIR/parallel_evidence.tgz holds it with the log.
# PARALLEL_ARGS adds arguments (e.g. '--layers 60'); RANKS changes the rank count (default 4).
# Run from the repository root on the GPU machine:  MMDIT_COMMIT=<hash> bash benchmarks/h200/parallel_evidence.sh OUT_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/evidence_common.sh"
evidence_begin parallel_evidence "${1:-}"
{
  evidence_header
  time timeout -s INT "${PARALLEL_S:-400}" python3 -m torch.distributed.run --standalone --nproc-per-node "${RANKS:-4}" \
    -m mmdit_strict.trajectories.layout_check --arch qwen-image --layers 4 --size 1024 --out "$ev" ${PARALLEL_ARGS:-}
  echo "parallel check exit $? (expected 0: every layout byte-equal to one rank)"
} 2>&1 | tee "$ev/log.txt"
cp "$ev/parallel_check.json" "$ev/parallel_check.md" "$out/" 2>/dev/null || echo "no report was written (see the log)" >&2
evidence_pack

#!/usr/bin/env bash
# `mmdit-strict train experiment=grpo_qwen_image_1024` (grpo_qwen_image at 1024² with ours' memory-lean options;
# 60 blocks, random BF16 weights, one epoch), to its end: the epoch's metrics, then the final checkpoint (LoRA, EMA, AdamW: 4.2 GB)
# and the LoRA export, which the last full-size run (a82e1e2) did not reach. The run folder stays on the machine;
# what comes back is the log, the metrics, the resolved config and a listing of every file the run wrote (bytes,
# seconds after the start at which it was last written, sha256 of the exported LoRA).
# GRPO_ARGS replaces the options (e.g. "experiment=grpo_tiny train.num_epochs=1" for a CPU smoke run).
# At 15c4710 on an H100 the process took 133 s (cold), the checkpoint and export 10 s of it.
# Run from the repository root on the GPU machine:  MMDIT_COMMIT=<hash> bash benchmarks/h200/grpo_evidence.sh OUT_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/evidence_common.sh"
evidence_begin grpo_evidence "${1:-}"
evidence_wheels  # omegaconf and wandb, which the GPU image lacks
run_dir="$work/run"
# (15c4710 ran the same options spelled out; experiment=grpo_qwen_image_1024 holds them since f695e06)
args=${GRPO_ARGS:-"experiment=grpo_qwen_image_1024 model.checkpoint=null train.num_epochs=1"}
{
  evidence_header
  start=$(date +%s.%N)
  echo "start $start"
  # shellcheck disable=SC2086  # the options are words
  time python3 -m mmdit_strict.cli.main train $args wandb.mode=offline output_dir="$run_dir"
  echo "train exit $?"
  python3 - "$run_dir" "$start" <<'EOF'
import hashlib, json, os, sys
root, start = sys.argv[1], float(sys.argv[2])
rows = []
for folder, _, files in sorted(os.walk(root)):
    for f in sorted(files):
        p = os.path.join(folder, f)
        st = os.stat(p)
        row = {"file": os.path.relpath(p, root), "bytes": st.st_size, "written_s_after_start": round(st.st_mtime - start, 2)}
        if os.path.relpath(p, root).startswith("lora" + os.sep):
            with open(p, "rb") as fh:
                row["sha256"] = hashlib.file_digest(fh, "sha256").hexdigest()
        rows.append(row)
print(json.dumps(rows, indent=1))
EOF
} 2>&1 | tee "$ev/log.txt"
cp "$run_dir"/metrics.jsonl "$run_dir"/config.yaml "$ev/" 2>/dev/null
evidence_pack

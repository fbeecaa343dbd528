#!/usr/bin/env bash
# Issue 30's GPU bar in one GPU call: `train experiment=grpo_qwen_image` cut to 4 blocks (random base weights,
# 2 epochs of 2 updates) on one process and on 2 ranks sharing the GPU through the host-staged gloo path
# (state hashes compared after every update); the adapter bytes must be equal. Then the fold/communication
# benchmark at full Qwen-Image LoRA size (benchmarks/fold_comm.py) and the GPU tests of tests/distributed.
# Run from the repository root on the GPU machine:  MMDIT_COMMIT=<hash> bash benchmarks/h200/distributed_evidence.sh OUT_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/evidence_common.sh"
evidence_begin distributed_evidence "${1:-}"
QWEN4=(--quiet experiment=grpo_qwen_image model.checkpoint=null model.num_layers=4 train.num_epochs=2 train.save_freq=1
       train.eval_freq=0 wandb.mode=disabled)
{
  evidence_header
  time python3 -m mmdit_strict train output_dir="$work/one" "${QWEN4[@]}"; echo "one process exit $?"
  time python3 -m torch.distributed.run --standalone --nproc-per-node=2 -m mmdit_strict train output_dir="$work/two" \
    "${QWEN4[@]}" distributed.backend=gloo distributed.check_state=update; echo "two ranks exit $?"
  for d in one two; do
    sha256sum "$work/$d"/lora/peft/adapter_model.safetensors "$work/$d"/lora/diffusers/pytorch_lora_weights.safetensors
    cp "$work/$d/metrics.jsonl" "$ev/metrics_$d.jsonl"
  done | tee "$ev/adapters.sha256"
  python3 - "$work" "$ev" <<'PY'
import hashlib, json, sys
from pathlib import Path
work, ev = Path(sys.argv[1]), Path(sys.argv[2])
rel = ["lora/peft/adapter_model.safetensors", "lora/diffusers/pytorch_lora_weights.safetensors"]
sha = {d: {r: hashlib.sha256((work / d / r).read_bytes()).hexdigest() for r in rel if (work / d / r).exists()} for d in ("one", "two")}
rows = {d: [json.loads(l) for l in (work / d / "metrics.jsonl").read_text().splitlines()] for d in ("one", "two") if (work / d / "metrics.jsonl").exists()}
equal = bool(sha["one"]) and sha["one"] == sha["two"]
out = {"adapters": sha, "adapters_equal": equal, "rows": rows}
(ev / "train_n1_n2.json").write_text(json.dumps(out, indent=2))
print("adapters equal (N=1 vs N=2 host-staged):", equal)
PY
  time python3 -m benchmarks.fold_comm --device cuda --ranks 2 4 --repeat 2 --out "$ev/fold_comm"; echo "fold_comm exit $?"
  rm -rf "$ev/fold_comm"/scratch_w*
  if [ "${DIST_PYTEST:-1}" = 1 ]; then  # DIST_PYTEST=0 when suite_evidence.sh runs every GPU test anyway
    time timeout -s INT 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs tests/distributed >"$ev/pytest_gpu_distributed.txt" 2>&1
    echo "pytest gpu distributed exit $?"; tail -15 "$ev/pytest_gpu_distributed.txt"
  fi
} 2>&1 | tee "$ev/log.txt"
evidence_pack

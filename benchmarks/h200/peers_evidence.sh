#!/usr/bin/env bash
# The peer survey (mmdit-strict bench peers) on the GPU, in one call of about 6 minutes: ours, PyTorch deterministic,
# SDPA's backends, Liger-Kernel and Megatron-Core's batch-invariant kernels through the same invariance / accuracy /
# speed checks at Qwen-Image's shapes (the `full` record set, mmdit_strict/bench/peers/plans.py), bf16 and fp32.
# The peers come from the wheels carried in .whl/ (fetch them with the repo's device-wheels tool:
# liger-kernel==0.8.5 megatron-core==0.16.1), installed into /tmp/site without network.
# Run from the repository root on the GPU machine:
#   MMDIT_COMMIT=<hash> bash benchmarks/h200/peers_evidence.sh OUT_DIR [--quick]
# OUT_DIR/peers.json and OUT_DIR/peers.md are the report; OUT_DIR/peers_evidence.tgz holds them with the log.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/evidence_common.sh"
evidence_begin peers_evidence "${1:-}"
quick=${2:-}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "could not install the carried wheels from .whl/" >&2; exit 2; }
export PYTHONPATH=/tmp/site:$PWD
export CUBLAS_WORKSPACE_CONFIG=:4096:8   # before CUDA starts: the torch-deterministic peer's cuBLAS setting
{
  evidence_header
  python3 -c 'import liger_kernel, importlib.metadata as m; print("liger-kernel", m.version("liger-kernel"), "megatron-core", m.version("megatron-core"))'
  time python3 -m mmdit_strict.bench.peers --out "$ev" --budget-s 330 $quick
} 2>&1 | tee "$ev/log.txt"
cp "$ev/peers.json" "$ev/peers.md" "$out/" 2>/dev/null || echo "no report was written (see the log)" >&2
evidence_pack

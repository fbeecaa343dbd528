#!/usr/bin/env bash
# Checkpoint load evidence of one commit, in one GPU call (about 6 minutes on an H200, most of it writing
# the checkpoint the first time):
#   1. the GPU byte test of the load path (`tests/model/test_checkpoint.py -m gpu`);
#   2. `bench load`: MMDiT.from_pretrained vs diffusers' QwenImageTransformer2DModel.from_pretrained(...).to("cuda")
#      on the same 60-block random BF16 checkpoint in 9 shards (written once, 41 GB, under LOAD_CACHE or
#      ~/.cache/mmdit_strict/load_bench: the machine's disk), 3 alternating pairs,
#      each load in its own process: seconds, peak host memory growth, weights hash.
# diffusers is not in the GPU image: carry its wheels (and any missing dependency) in .whl/; they are installed
# into /tmp/site without network. Run from the repository root on the GPU machine:
#   MMDIT_COMMIT=<hash> bash benchmarks/h200/load_evidence.sh OUT_DIR     (OUT_DIR: $OUT on the device machine)
# OUT_DIR/load_bench.json and OUT_DIR/load_bench.md are the report; OUT_DIR/load_evidence.tgz holds them with the log.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/evidence_common.sh"
evidence_begin load_evidence "${1:-}"
evidence_wheels
python3 -c 'import diffusers' || { echo "diffusers is not importable: carry its wheels in .whl/" >&2; exit 2; }
cache=(); [ -n "${LOAD_CACHE:-}" ] && cache=(--cache "$LOAD_CACHE")
{
  evidence_header
  df -h "${LOAD_CACHE:-$HOME}" | tail -1
  free -g | head -2
  evidence_run python3 -m pytest -q -p no:cacheprovider -m gpu tests/model/test_checkpoint.py
  evidence_run python3 -m mmdit_strict.bench.load --out "$ev" --device cuda --repeats 3 "${cache[@]}"
} 2>&1 | tee "$ev/log.txt"
cp "$ev/load_bench.json" "$ev/load_bench.md" "$out/" 2>/dev/null || echo "no report was written (see the log)" >&2
evidence_pack

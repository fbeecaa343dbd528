# Sourced (never run) by the *_evidence.sh scripts of this folder: what every evidence call does the same way.
#   evidence_begin NAME OUT_DIR   out=OUT_DIR (required, made), work=a fresh temporary folder, ev=$work/NAME (made);
#                                 unbuffered Python output
#   evidence_header               the GPU and driver, torch / triton / CUDA versions, the commit (MMDIT_COMMIT)
#   evidence_pack                 OUT_DIR/NAME.tgz: the NAME folder, one file (device transfers limit the file count)
#   evidence_run CMD...           time CMD, then evidence_pack: a call cut by its time limit still returns the reports
#                                 of the steps that finished
#   evidence_wheels               the wheels carried in .whl/ (diffusers, ...) installed into /tmp/site without
#                                 network and put on PYTHONPATH with the repository; exits 2 if they do not install

evidence_begin() {
  name=$1
  out=${2:?usage: $1.sh OUT_DIR}
  mkdir -p "$out"  # the report and the .tgz land here
  work=$(mktemp -d)
  ev="$work/$name"
  mkdir -p "$ev"
  export PYTHONUNBUFFERED=1
}

evidence_header() {
  nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)'
  echo "commit ${MMDIT_COMMIT:-unset}"
}

evidence_pack() {
  tar -C "$work" -czf "$out/$name.tgz.part" "$name" && mv "$out/$name.tgz.part" "$out/$name.tgz"
}

evidence_run() {
  local rc
  time "$@"
  rc=$?
  evidence_pack
  return $rc
}

evidence_wheels() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "could not install the carried wheels from .whl/" >&2; exit 2; }
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD
  fi
}

set -u
T0=$(date +%s)
TOTAL=${TOTAL:-340}
left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
export MMDIT_COMMIT=6bb721d
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OMP_NUM_THREADS=2 timeout -s INT 100 python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfEs tests/kernels/test_fold_park.py tests/model/test_graphs.py tests/model/test_train_graphs.py tests/kernels/test_grad_sink.py tests/training/test_gpu_training.py > $OUT/pytest_gpu.txt 2>&1
echo "gpu tests rc $? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/pytest_gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | head
for v in parked unparked; do
  T=$(( $(left) - 3 )); [ $T -lt 60 ] && break
  extra="--no-profile --engines ours"; [ $v = parked ] && extra="$extra --park-fold-nodes"
  TRAIN_SHAPE=epoch TRAIN_EXTRA="$extra" timeout $T bash benchmarks/h200/train_evidence.sh $OUT/$v > $OUT/${v}_log.txt 2>&1
  echo "$v rc $? at $(( $(date +%s) - T0 )) s"; sed -n '/Per phase/,$p' $OUT/$v/train_bench.md | grep "|" | grep -v -- "---"
done

set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
export PYTHONUNBUFFERED=1
( PYTHONPATH=/tmp/site:$PWD MMDIT_COMMIT=2c6f1af timeout 120 python3 -m pytest -q -m gpu tests/model/test_gpu_syncs.py -p no:cacheprovider -rfEs 2>&1 | tail -15 ) > $OUT/sync_test.txt 2>&1
for c in 5f75022 7345138 cab7aef 75b2d2c 5661456 ae5c283 31f18ec a61a431 8360b21 HEAD; do
  if [ $c = HEAD ]; then p=$PWD; else p=$PWD/bisect/$c; fi
  prof=""; case $c in 5f75022|HEAD) prof=1;; esac
  echo "== $c"
  PYTHONPATH=/tmp/site:$p MMDIT_COMMIT=$c timeout 150 python3 bisect/fwd_time.py 8 $prof > $OUT/fwd_$c.txt 2>&1
  grep RESULT $OUT/fwd_$c.txt || tail -5 $OUT/fwd_$c.txt
done
cat $OUT/sync_test.txt

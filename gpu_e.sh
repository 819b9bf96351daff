#!/bin/bash
# device run E: GPU checks of this session's fixes (kv_offload, hybrid, V3.2, eagle3 graphs), bench_hybrid
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
e=(-e core); for p in plugins/*/; do e+=(-e "$p"); done
python3 -m pip install -q --no-deps --no-build-isolation "${e[@]}" 2>&1 | tail -2
t() { name=$1; limit=$2; shift 2; s=$SECONDS; timeout -s INT -k 10 $limit python3 -m pytest -m gpu -q -s -p no:cacheprovider \
  -rfE "$@" > $OUT/t_$name.txt 2>&1; echo "== $name rc=$? $((SECONDS-s))s"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/t_$name.txt | tail -4; }
t offload 100 plugins/kv_offload/tests/test_transfer.py plugins/kv_offload/tests/test_pd_gpu.py plugins/kv_offload/tests/test_engine.py
t recur 50 core/tests/ops/test_recurrent_gpu.py
t hybrid 80 tests/test_gpu_hybrid.py
t v32 80 plugins/cuda_mla/tests/test_gpu_v32_engine.py
grep -h "top-5 gaps" $OUT/t_v32.txt
t eagle3 60 plugins/spec_decode/tests/test_eagle3_gpu.py
s=$SECONDS; timeout -s INT 50 python3 benchmarks/bench_hybrid.py > $OUT/bench_hybrid.txt 2>&1; echo "== bench_hybrid rc=$? $((SECONDS-s))s"
grep -v Warn $OUT/bench_hybrid.txt | tail -22

#!/bin/bash
# device run C: install, keep the first GGUF half, GPU tests fixed this session (each file alone)
export PYTHONUNBUFFERED=1
mkdir -p /tmp/smol && cp .smol_a/part /tmp/smol/part_a
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
e=(-e core); for p in plugins/*/; do e+=(-e "$p"); done
python3 -m pip install -q --no-deps --no-build-isolation "${e[@]}" 2>&1 | tail -2
t() { name=$1; shift; timeout $1 python3 -m pytest -m gpu -q -p no:cacheprovider -p no:hypothesispytest \
  --timeout $1 -rfE "${@:2}" > $OUT/t_$name.txt 2>&1; echo "== $name rc=$?"; grep -E "passed|failed|error" $OUT/t_$name.txt | tail -2; }
t nccl 200 core/tests/distributed/test_nccl.py
t offload 120 plugins/kv_offload
t spec 240 plugins/spec_decode
t v32 150 plugins/cuda_mla/tests/test_gpu_v32_engine.py

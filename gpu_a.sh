#!/bin/bash
# device run A: install, keep the first GGUF half, the GPU tests never run so far, bench_hybrid
export PYTHONUNBUFFERED=1
mkdir -p /tmp/smol && cp .smol_a/part /tmp/smol/part_a
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
e=(-e core); for p in plugins/*/; do e+=(-e "$p"); done
python3 -m pip install -q --no-deps --no-build-isolation "${e[@]}" 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.used --format=csv
python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1
timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 300 -rfE \
  core/tests/ops/test_recurrent_gpu.py tests/test_gpu_hybrid.py plugins/spec_decode plugins/kv_offload \
  core/tests/distributed/test_nccl.py > $OUT/gpu_tests.txt 2>&1
tail -40 $OUT/gpu_tests.txt
timeout 200 python3 benchmarks/bench_hybrid.py > $OUT/hybrid.txt 2>&1
grep -v Warn $OUT/hybrid.txt | tail -30

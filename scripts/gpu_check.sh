#!/usr/bin/env bash
# One call on the GPU machine: install the working tree (no network there), run every
# GPU-marked test and the GPU benchmarks, and leave logs in $OUT (the device tool's folder).
set -uo pipefail
out="${OUT:-/tmp/jackfield-gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 JACKFIELD_CACHE=/tmp/jackfield-cache
editables=(-e core)
for plugin in plugins/*/; do editables+=(-e "$plugin"); done
python3 -m pip install -q --no-deps --no-build-isolation "${editables[@]}" \
    > "$out/pip.log" 2>&1 || { echo "pip install failed"; tail -5 "$out/pip.log"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -m jackfield.cli plugins > "$out/plugins.txt" 2>&1; grep -A1 "cuda_mla " "$out/plugins.txt"
# The float64 references of cuda_mla's full-shape tests are CPU work: spread them over workers
# where pytest-xdist is installed (serially they outlast 200 s on the H200 host; 8 workers: 124 s).
# The rest runs serially (engine tests side by side on one GPU have not been tried).
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider $workers plugins/cuda_mla \
    > "$out/gpu_tests_cuda_mla.log" 2>&1; tail -3 "$out/gpu_tests_cuda_mla.log"
# cuda_attn: its gpu tests and its kernel tests (which take the GPU where there is one).
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider $workers -k "not Interpreted" \
    plugins/cuda_attn \
    > "$out/gpu_tests_cuda_attn.log" 2>&1; tail -3 "$out/gpu_tests_cuda_attn.log"
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider core plugins/cpu_amx tests \
    > "$out/gpu_tests.log" 2>&1; tail -3 "$out/gpu_tests.log"
timeout 60 python3 -m jackfield.cli run --max-tokens 32 > "$out/run.txt" 2>&1; tail -4 "$out/run.txt"
for bench in ${BENCHES:-bench_mla bench_attn bench_e2e bench_sampler accuracy_e2e}; do
    timeout "${BENCH_TIMEOUT:-240}" python3 "benchmarks/$bench.py" > "$out/$bench.txt" 2>&1
    echo "== $bench (rc=$?)"; tail -25 "$out/$bench.txt"
done

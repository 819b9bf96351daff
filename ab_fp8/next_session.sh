#!/usr/bin/env bash
# One H200 call for branch fp8-regs (run from the worktree root, carried as .diag/wt-regs):
#   run(command="cd .diag/wt-regs && bash ab_fp8/next_session.sh", carry=[".diag/wt-regs"])
# GPU tests first (a hang shows as a timeout), then the one-process A/B, then bench_mla's H16 rows.
set -uo pipefail
out="${OUT:-/tmp/fp8-regs}"; mkdir -p "$out"; export PYTHONUNBUFFERED=1 JACKFIELD_CACHE=/tmp/jfc
t0=$SECONDS
python3 -m pip install -q --no-deps --no-build-isolation -e core -e plugins/cuda_mla -e plugins/cpu_amx > "$out/pip.log" 2>&1 || tail -3 "$out/pip.log"
echo "== register kernel GPU tests ($((SECONDS-t0)) s)"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 --timeout 60 \
    plugins/cuda_mla/tests/test_gpu_gluon_few.py plugins/cuda_mla/tests/test_gpu_graphs.py > "$out/few_tests.log" 2>&1
echo "rc=$?"; tail -1 "$out/few_tests.log"; grep -E "^FAILED|^ERROR|Timeout" "$out/few_tests.log" | head -20
echo "== A/B ($((SECONDS-t0)) s)"
timeout 120 python3 ab_fp8/ab_registers.py --rounds 5 2>&1 | tail -8
echo "== all cuda_mla GPU tests ($((SECONDS-t0)) s)"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 --timeout 120 plugins/cuda_mla/tests > "$out/mla_tests.log" 2>&1
echo "rc=$?"; tail -1 "$out/mla_tests.log"; grep -E "^FAILED|^ERROR|Timeout" "$out/mla_tests.log" | head -20
echo "== bench_mla H16 ($((SECONDS-t0)) s)"
timeout $((560-(SECONDS-t0))) python3 benchmarks/bench_mla.py --only "H16" --no-insert --out "$out/bench_h16.md" > "$out/bench.log" 2>&1
echo "rc=$?"; tail -8 "$out/bench.log"
echo "== done ($((SECONDS-t0)) s)"

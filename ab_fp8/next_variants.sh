#!/usr/bin/env bash
# One H200 call (from the main checkout's root):
#   run(command="bash .diag/s7/next_variants.sh", carry=[".diag/s7", ".diag/wt-pv", ".diag/wt-sum"])
# A/B of the fp8 <= 16-row register kernel: main vs fp8-pv (PV one value half at a time: no spills)
# vs fp8-sum (that + row sums reduced across warps once at the end), each in its own process with
# its own bf16 baseline; then the GPU tests of both variants.
set -uo pipefail
out="${OUT:-/tmp/variants}"; mkdir -p "$out"; export PYTHONUNBUFFERED=1 JACKFIELD_CACHE=/tmp/jfc
root=$PWD; t0=$SECONDS
install() {  # editable install of one tree; says which tree the kernel module now comes from
    (cd "$root/$1" && python3 -m pip install -q --no-deps --no-build-isolation -e core -e plugins/cuda_mla \
        -e plugins/cpu_amx > "$out/pip_${1##*/}.log" 2>&1) || { echo "pip install of $1 failed"; tail -3 "$out/pip_${1##*/}.log"; }
    (cd / && python3 -c 'import jackfield_cuda_mla.kernels.decode_gluon_fp8 as m; print("kernel from", m.__file__)')
}
for tree in . .diag/wt-pv .diag/wt-sum; do
    install "$tree"
    echo "== A/B $tree ($((SECONDS-t0)) s)"
    (cd "$root" && timeout -k 5 90 python3 .diag/s7/ab_registers.py --rounds 5 2>&1 | tail -7)
done
for tree in .diag/wt-pv .diag/wt-sum; do
    install "$tree"
    echo "== GPU tests $tree ($((SECONDS-t0)) s)"
    (cd "$root/$tree" && timeout -k 5 100 python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 --timeout 60 \
        plugins/cuda_mla/tests/test_gpu_gluon_few.py plugins/cuda_mla/tests/test_gpu_graphs.py > "$out/tests_${tree##*/}.log" 2>&1
     echo "rc=$?"; tail -1 "$out/tests_${tree##*/}.log"; grep -E "^FAILED|^ERROR" "$out/tests_${tree##*/}.log" | head -5)
done
echo "== done ($((SECONDS-t0)) s)"

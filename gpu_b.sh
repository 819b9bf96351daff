#!/bin/bash
# device run B: join the GGUF, bench_spec (EOS workload), bench_offload, hybrid e2e
export PYTHONUNBUFFERED=1
cat /tmp/smol/part_a .smol_b/part > /tmp/smol.gguf && sha256sum /tmp/smol.gguf | cut -c1-16
export PYTHONPATH=/tmp/site
timeout 240 python3 benchmarks/bench_spec.py --model-dir /tmp/smol.gguf > $OUT/spec.txt 2>&1
grep -v "Processed req\|Warn" $OUT/spec.txt | tail -30
timeout 150 python3 benchmarks/bench_offload.py --device cuda > $OUT/offload.txt 2>&1
grep -v Warn $OUT/offload.txt | tail -25
for fam in qwen3-next granite-hybrid; do
  timeout 90 python3 benchmarks/bench_e2e.py --family $fam --batches 1,16,64 > $OUT/e2e_$fam.txt 2>&1
  grep -v Warn $OUT/e2e_$fam.txt | tail -14
done

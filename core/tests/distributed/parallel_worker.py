"""One torchrun rank of the parallel engine tests: runs every job of a JSON file through the
Python API (`LLM`) and writes, from rank 0, what each job generated and its KV facts.

    python -m torch.distributed.run --standalone --nproc-per-node N parallel_worker.py JOBS OUT

A job: {"name", "model", "config" (LLM keyword arguments), "prompts", "max_tokens"}. Every rank
checks that the others generated the same tokens (a rank that disagrees fails the run).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from jackfield import LLM, SamplingParams


def run_job(job: dict[str, object]) -> dict[str, object]:
    llm = LLM(job["model"], **job["config"])  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=int(job["max_tokens"]), ignore_eos=True)  # type: ignore[call-overload]
    prompts: list[list[int]] = job["prompts"]  # type: ignore[assignment]
    first = [o.token_ids for o in llm.generate(prompts, params)]
    again = llm.generate(prompts, params)  # prefix-cache hits on the prompts' full blocks
    engine = llm.engine
    # Blocks one request holds once its prompt is computed: (block_size * dcp) tokens per block.
    longest = max(prompts, key=len)
    seq = engine.add_request(longest, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while not seq.output_ids:
        engine.step()
    blocks_after_prefill = len(seq.block_tables[0])
    while engine.scheduler.has_work():
        engine.step()
    return {
        "tokens": first,
        "tokens_again": [o.token_ids for o in again],
        "cached_tokens": sum(o.num_cached_tokens for o in again),
        "num_blocks": engine.runner.kv.num_blocks,
        "tokens_per_block": engine.tokens_per_block,
        "blocks_after_prefill": blocks_after_prefill,
        "prompt_len": len(longest),
    }


def main(jobs_path: str, out_path: str) -> None:
    jobs = json.loads(Path(jobs_path).read_text())
    results = {}
    for job in jobs:
        result = run_job(job)
        every: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(every, result["tokens"])
        if any(tokens != result["tokens"] for tokens in every):
            raise AssertionError(f"{job['name']}: the ranks generated different tokens: {every}")
        results[job["name"]] = result
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""`torchrun --nproc-per-node 2 -m jackfield.cli run` (one spawn): rank 0 prints one JSON
object, whose greedy tokens are one process's, with tp 2 and dcp 2 on the embedded model."""

from __future__ import annotations

import json

from jackfield import LLM, SamplingParams
from jackfield.testing.torchrun import torchrun

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3]]


def test_torchrun_cli_prints_once_and_matches_one_process() -> None:
    args = ["-m", "jackfield.cli", "run", "--json", "--temperature", "0", "--max-tokens", "5",
            "--set", "parallel.tensor_parallel_size=2", "--set", "parallel.dcp_size=2"]
    for prompt in PROMPTS:
        args += ["--prompt-token-ids", ",".join(map(str, prompt))]
    run = torchrun(2, args, timeout_s=600)
    printed = json.loads(run.stdout)  # one object: rank 1 printed nothing
    want = [o.token_ids for o in LLM().generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5))]
    assert [o["token_ids"] for o in printed["outputs"]] == want

"""One LLM from several threads, and a step that fails: each thread gets its lone-run tokens, and
a failed call leaves the engine serving the next (issue 23, classes 2 and 3)."""

from __future__ import annotations

import threading

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.contracts.sampler import Sampler, SamplerOutput, SamplingMetadata


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    print(f"prompt seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def test_threads_sharing_one_llm_get_their_lone_run_tokens(v3_dir) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(v3_dir, backend="torch_ref", block_size=16, max_num_batched_tokens=48)
    work = [(_prompts(10 + i, (9 + 7 * i, 30 - 5 * i)),
             SamplingParams(temperature=0.8, seed=100 + i, max_tokens=10, ignore_eos=True)) for i in range(4)]
    alone = [[o.token_ids for o in llm.generate(prompts, params)] for prompts, params in work]
    got: list[list[list[int]] | BaseException | None] = [None] * len(work)

    def call(i: int) -> None:
        try:
            got[i] = [o.token_ids for o in llm.generate(*work[i])]
        except BaseException as exc:  # reported below with the thread's index
            got[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(work))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a generate call hung"
    assert got == alone


class FailingSampler(Sampler):
    """Raises on every call: a step that samples fails inside the engine."""

    name = "failing"

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        raise RuntimeError("sampler exploded")


def test_a_failed_step_frees_its_requests_and_the_engine_serves_the_next_call(v3_dir) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(v3_dir, backend="torch_ref", block_size=16, max_num_batched_tokens=48)
    prompts = _prompts(20, (12, 40, 33))
    sampled = SamplingParams(temperature=0.7, seed=5, max_tokens=8, ignore_eos=True)
    want = llm.generate(prompts, sampled)
    free = llm.engine.block_manager.num_free
    runner = llm.engine.runner
    working, runner.sampler = runner.sampler, FailingSampler()
    with pytest.raises(RuntimeError, match="sampler exploded"):
        llm.generate(prompts, sampled)
    assert not llm.engine.scheduler.has_work()
    assert llm.engine.block_manager.num_free == free
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in greedy] == [4, 4, 4]  # all-greedy steps take no sampler
    runner.sampler = working
    assert [o.token_ids for o in llm.generate(prompts, sampled)] == [o.token_ids for o in want]

"""Async scheduling on the GPU: decode steps pipelined (schedule N+1 -> launch N+1 -> finish N)
and replayed from CUDA graphs through cuda_attn, step N's sampled tokens written into step N+1's
graph inputs on the device, against the same engine run synchronously.

Every request here stops by max_tokens, which the scheduler knows in advance, so both modes run
the same batch at every step through the same recorded graphs: the tokens must agree exactly
(greedy and seeded random rows). The CPU tests (core/tests/engine/test_async_scheduling.py)
cover stops seen a step late, aborts, prefix caching and preemption.

  pytest plugins/cuda_attn/tests/test_gpu_async_engine.py -s
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.testing.checkpoints import write_granite

pytestmark = pytest.mark.gpu

SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)  # head size 64


@pytest.fixture(scope="module", params=["llama", "granite_swa"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp(request.param)
    window = {"sliding_window": 40} if request.param == "granite_swa" else {}
    write_granite(request.param, directory, seed=1, **SHAPE, **window)
    return directory


def generate(directory: Path, async_on: bool, prompts: list[list[int]], params: list[SamplingParams],
             ) -> tuple[list[list[int]], list[bool]]:
    """Each request's tokens, and per replayed decode step whether it took in-flight tokens."""
    llm = LLM(str(directory), **{"engine.device": "cuda", "model.dtype": "bfloat16",
                                 "attention.backend": "cuda_attn", "engine.max_num_seqs": 32,
                                 "engine.async_scheduling": async_on})
    graphs = llm.engine.runner.graphs
    assert graphs is not None, llm.engine.runner.decode_graphs_off
    replays: list[bool] = []
    run = graphs.run

    def counted_run(chunks, q, taps=None, in_flight=None):  # type: ignore[no-untyped-def]
        replays.append(in_flight is not None)
        return run(chunks, q, taps, in_flight)

    graphs.run = counted_run  # type: ignore[method-assign]
    tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, replays


def test_pipelined_replays_give_the_synchronous_tokens(checkpoint: Path, rng_seed: int) -> None:
    print(f"seed={rng_seed}")
    gen = torch.Generator().manual_seed(rng_seed)
    lengths = torch.randint(1, 200, (24,), generator=gen).tolist()
    prompts = [torch.randint(0, SHAPE["vocab_size"], (n,), generator=gen).tolist() for n in lengths]
    max_tokens = torch.randint(8, 48, (24,), generator=gen).tolist()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) if i % 2 == 0
              else SamplingParams(temperature=0.8, top_k=40, seed=i, max_tokens=n, ignore_eos=True)
              for i, n in enumerate(max_tokens)]
    want, sync_replays = generate(checkpoint, False, prompts, params)
    got, replays = generate(checkpoint, True, prompts, params)
    print(f"replayed decode steps: synchronous {len(sync_replays)}, pipelined {len(replays)} "
          f"({sum(replays)} with in-flight tokens)")
    assert not any(sync_replays) and sum(replays) >= 20
    assert got == want

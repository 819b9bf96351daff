"""train_eagle3's time-bounded data (issue 18): `answers_within` keeps the answers that finish
before its deadline, each the engine's own greedy answer (as `LLM.generate` gives it), drops the
ones cut off, and leaves the engine clean for the next call; it draws its prompts as the engine
has room, never holding more than `queued` unfinished requests."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.testing.checkpoints import write_granite

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def train_eagle3(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # its imports of the other benchmarks
    spec = importlib.util.spec_from_file_location("train_eagle3", BENCHMARKS / "train_eagle3.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "train_eagle3", module)  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def tiny_llm_and_prompts(directory: Path, seed: int, max_num_seqs: int,
                         count: int) -> tuple[LLM, list[list[int]], torch.Generator]:
    """A tiny random Llama on the CPU, `count` random prompts of 3-8 tokens, and the generator
    that drew them (seeded with `seed`), for the test's further draws."""
    write_granite("llama_tied", directory, seed, num_hidden_layers=2, max_position_embeddings=128)
    llm = LLM(str(directory), **{"engine.device": "cpu", "attention.backend": "torch_ref",
                                 "model.dtype": "float32", "engine.max_num_seqs": max_num_seqs})
    g = torch.Generator().manual_seed(seed)
    vocab = llm.engine.capabilities.vocab_size
    lengths = torch.randint(3, 9, (count,))
    prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in lengths]
    return llm, prompts, g


def test_answers_within_keeps_the_answers_finished_in_time(tmp_path: Path, train_eagle3: ModuleType,
                                                           rng_seed: int) -> None:
    print(f"seed {rng_seed}")
    llm, prompts, _ = tiny_llm_and_prompts(tmp_path, rng_seed, max_num_seqs=4, count=6)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def generated() -> list[tuple[list[int], int]]:
        outputs = llm.generate(prompts, greedy)
        return [(p + o.token_ids, len(p)) for p, o in zip(prompts, outputs, strict=True)]

    expected = generated()

    assert train_eagle3.answers_within(llm, prompts, greedy, 60.0, 8) == expected
    # a clock that moves one second a reading (one a step): the deadline falls while the second
    # wave (4 rows a step at most) still decodes, so the first wave's answers are kept, the rest dropped
    ticks = itertools.count()
    cut = train_eagle3.answers_within(llm, prompts, greedy, 16.0, 4,
                                     clock=lambda: float(next(ticks)))
    print(f"{len(cut)} of {len(prompts)} answers finished in time")
    assert 0 < len(cut) < len(prompts)
    assert all(example in expected for example in cut), "a kept answer is not the full greedy answer"
    assert not llm.engine.has_work()
    assert train_eagle3.answers_within(llm, prompts, greedy, 0.0, 8) == []
    assert generated() == expected  # the engine serves the next call as before


def test_answers_within_draws_prompts_as_the_engine_has_room(
        tmp_path: Path, train_eagle3: ModuleType, monkeypatch: pytest.MonkeyPatch, rng_seed: int) -> None:
    """With room for 3 unfinished requests (a batch of 2), no more are ever queued, the answers
    are those of one `generate` call over all prompts, and prompts past the deadline are never drawn."""
    print(f"seed {rng_seed}")
    llm, prompts, g = tiny_llm_and_prompts(tmp_path, rng_seed, max_num_seqs=2, count=7)
    # lengths that differ, so that requests finish at different steps
    params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True)
              for n in torch.randint(2, 10, (len(prompts),), generator=g)]
    outputs = llm.generate(prompts, params)
    expected = [(p + o.token_ids, len(p)) for p, o in zip(prompts, outputs, strict=True)]
    by_prompt = {tuple(p): q for p, q in zip(prompts, params, strict=True)}

    queued, added = [], []
    add_requests = llm.engine.add_requests

    def counted(requests: list) -> list:
        requests = [(prompt, by_prompt[tuple(prompt)]) for prompt, _ in requests]  # each its own length
        seqs = add_requests(requests)
        added.extend(seqs)
        queued.append(sum(seq.finish_reason is None for seq in added))
        return seqs

    monkeypatch.setattr(llm.engine, "add_requests", counted)
    drawn = []

    def drawing() -> object:
        for prompt in prompts:
            drawn.append(prompt)
            yield prompt

    greedy = SamplingParams(temperature=0.0, max_tokens=1)  # replaced per prompt above
    assert train_eagle3.answers_within(llm, drawing(), greedy, 60.0, 3) == expected
    print(f"unfinished after each draw: {queued}")
    assert max(queued) == 3 and len(drawn) == len(prompts)
    ticks = itertools.count()
    drawn.clear()
    cut = train_eagle3.answers_within(llm, drawing(), greedy, 4.0, 3, clock=lambda: float(next(ticks)))
    # the kept answers, in the order drawn: a later prompt's short answer may finish before an
    # earlier prompt's long one, which the deadline then cuts off
    kept = iter(expected[: len(drawn)])
    assert all(example in kept for example in cut) and len(drawn) < len(prompts), (len(cut), len(drawn))
    assert not llm.engine.has_work()

"""The CPU steps' thread count: measured once during the warm-up, then fixed; or pinned.

The engine tests run the real warm-up on the tiny model, with a simulated clock: each step
"takes" a chosen time per thread count, so which count wins is known in advance."""

from __future__ import annotations

import json
import random

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.cli import main
from jackfield.config import ConfigError
from jackfield.engine import engine as engine_module
from jackfield.engine.cpu_threads import ROUNDS, CpuThreads, thread_candidates
from jackfield.engine.model_runner import ModelRunner


def test_candidates() -> None:
    assert thread_candidates(16) == (16, 8, 4, 2, 1)
    assert thread_candidates(6) == (6, 3, 1)
    assert thread_candidates(1) == (1,)


def test_choose_takes_the_lowest_median() -> None:
    """The median, not the mean: one step hit by a load spike does not decide."""
    threads = CpuThreads(4, (4, 2, 1), pinned=False)
    for seconds in (0.010, 0.011, 0.900):  # 4 threads: fast but one spike (mean 0.31 s)
        threads.record(4, seconds)
    for seconds in (0.020, 0.021, 0.022):
        threads.record(2, seconds)
    assert threads.choose() == 4
    threads.record(1, 0.005)
    assert threads.choose() == 1
    assert threads.summary() == {"threads": 1, "source": "measured",
                                 "decode_step_ms": {4: 11.0, 2: 21.0, 1: 5.0}}


def test_run_at_sets_and_restores_the_pool() -> None:
    before = torch.get_num_threads()
    threads = CpuThreads(before + 1, (before + 1,), pinned=True)
    with threads.run_at():
        assert torch.get_num_threads() == before + 1
    with pytest.raises(RuntimeError), threads.run_at(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError("a failed step")
    assert torch.get_num_threads() == before


def spy_steps(llm: LLM) -> list[int]:
    """The pool size each later step of `llm` runs at."""
    seen: list[int] = []
    step = llm.engine.runner._step

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(torch.get_num_threads())
        return step(*args, **kwargs)

    llm.engine.runner._step = spy  # type: ignore[method-assign]
    return seen


@pytest.fixture
def pool_of_four() -> object:
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("pool_of_four")
def test_auto_measures_once_and_keeps_the_fastest(v3_dir, monkeypatch) -> None:
    """Steps cost a random time per thread count (the simulated clock); the warm-up times each
    candidate ROUNDS times, keeps the cheapest, and every later step runs at it, whatever the
    steps cost then (a count that followed the load would let runs differ)."""
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    cost = {c: rng.uniform(0.01, 1.0) for c in (4, 2, 1)}
    clock = [0.0]

    class FakeTime:
        @staticmethod
        def perf_counter() -> float:
            return clock[0]

    step = ModelRunner._step

    def costed_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        clock[0] += cost[torch.get_num_threads()]
        return step(self, *args, **kwargs)

    monkeypatch.setattr(engine_module, "time", FakeTime)
    monkeypatch.setattr(ModelRunner, "_step", costed_step)
    llm = LLM(str(v3_dir), **{"engine.device": "cpu"})
    threads = llm.engine.runner.cpu_threads
    assert threads is not None and threads.candidates == (4, 2, 1)
    best = min(cost, key=cost.__getitem__)
    assert threads.threads == best
    assert {c: len(t) for c, t in threads.timings_s.items()} == {4: ROUNDS, 2: ROUNDS, 1: ROUNDS}
    assert all(t == pytest.approx(cost[c]) for c, ts in threads.timings_s.items() for t in ts)
    cost.update({c: 1.0 for c in cost} | {4 if best != 4 else 1: 0.001})  # the load changed
    seen = spy_steps(llm)
    llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_tokens=6))
    assert seen and set(seen) == {best} and torch.get_num_threads() == 4
    assert llm.engine._next_id == 2  # the warm-up's requests left no ids behind


@pytest.mark.usefixtures("pool_of_four")
def test_auto_measures_under_async_scheduling(v3_dir) -> None:
    """A pipelined warm-up request takes one step more (reading its last token back): every
    candidate is still timed ROUNDS times, and the engine starts."""
    llm = LLM(str(v3_dir), **{"engine.device": "cpu", "engine.async_scheduling": True})
    threads = llm.engine.runner.cpu_threads
    assert threads is not None and threads.candidates == (4, 2, 1)
    assert {c: len(t) for c, t in threads.timings_s.items()} == {4: ROUNDS, 2: ROUNDS, 1: ROUNDS}
    assert llm.engine._next_id == 0


@pytest.mark.usefixtures("pool_of_four")
def test_pipelined_steps_run_at_the_count_too(v3_dir) -> None:
    """Async scheduling on the CPU: the launched decode steps, not only the synchronous ones, run
    at the engine's count."""
    llm = LLM(str(v3_dir), **{"engine.device": "cpu", "engine.cpu_threads": 1,
                              "engine.async_scheduling": True})
    seen = spy_steps(llm)
    launched: list[int] = []
    launch = llm.engine.runner._launch

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        launched.append(torch.get_num_threads())
        return launch(*args, **kwargs)

    llm.engine.runner._launch = spy  # type: ignore[method-assign]
    llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_tokens=6))
    assert seen and launched and set(seen + launched) == {1} and torch.get_num_threads() == 4


@pytest.mark.usefixtures("pool_of_four")
def test_a_pinned_count_is_never_measured(v3_dir) -> None:
    llm = LLM(str(v3_dir), **{"engine.device": "cpu", "engine.cpu_threads": 1})
    threads = llm.engine.runner.cpu_threads
    assert threads is not None and threads.summary() == {
        "threads": 1, "source": "engine.cpu_threads", "decode_step_ms": {}}
    seen = spy_steps(llm)
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))
    assert seen == [1] * 4 and torch.get_num_threads() == 4
    for bad in (0, -1, "fast"):
        with pytest.raises(ConfigError, match="engine.cpu_threads"):
            LLM(str(v3_dir), **{"engine.device": "cpu", "engine.cpu_threads": bad})


@pytest.mark.usefixtures("pool_of_four")
def test_jackfield_run_reports_the_count(capsys: pytest.CaptureFixture[str]) -> None:
    """`jackfield run` on the CPU: the count and where it came from, in --json and in a line."""
    args = ["run", "--max-tokens", "2", "--device", "cpu", "--prompt-token-ids", "5,17,42"]
    assert main([*args, "--json", "--set", "engine.cpu_threads=1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cpu_threads"] == {"threads": 1, "source": "engine.cpu_threads", "decode_step_ms": {}}
    assert main(args) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("cpu threads:"))
    count, timed = line.removeprefix("cpu threads: ").split(" (measured: decode step ")
    assert int(count) in (4, 2, 1)
    assert [part.split(" ms at ")[1] for part in timed.rstrip(")").split(", ")] == ["4", "2", "1"]

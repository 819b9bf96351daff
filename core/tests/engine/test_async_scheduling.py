"""Async scheduling (`engine.async_scheduling = true`) on the CPU against the synchronous engine.

The pipelined path (schedule N+1 -> launch N+1 -> finish N; step N's sampled tokens feed step
N+1's input ids through a gather on the device; stops seen a step late) is the one CUDA runs,
less the overlap. Every test compares real tokens, finish reasons and block-manager state with
the same engine run synchronously (whose own tokens other tests pin against transformers), over
random prompts drawn from the test's printed seed. The GPU counterpart (replayed CUDA graphs):
plugins/cuda_attn/tests/test_gpu_async_engine.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.engine.engine import Engine
from jackfield.engine.sequence import Sequence, Status
from jackfield.testing.checkpoints import write_deepseek, write_granite

BLOCK = 4
FAMILIES = ("llama", "granite_swa", "deepseek_v3")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random checkpoints built with transformers' config classes: Llama (GQA), Granite SWA
    (window layers beside a full one: several KV cache groups), DeepSeek-V3 (MLA)."""
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "deepseek_v3":
        write_deepseek("v3", directory, seed=3)
    else:
        write_granite(request.param, directory, seed=1)
    return directory


def make(directory: Path | str, async_on: bool, **overrides: object) -> LLM:
    settings = {"device": "cpu", "backend": "torch_ref", "block_size": BLOCK, "max_num_seqs": 8,
                "engine.async_scheduling": async_on}
    return LLM(str(directory), **{**settings, **overrides})


def prompts_of(llm: LLM, seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    vocab = llm.engine.capabilities.vocab_size
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def mixed_params(max_tokens: tuple[int, ...], **common: object) -> list[SamplingParams]:
    """Greedy and seeded random rows alternating (the sampler's noise is keyed by position: a
    position off by one under async scheduling changes the draws)."""
    return [SamplingParams(temperature=0.0, max_tokens=n, **common) if i % 2 == 0
            else SamplingParams(temperature=0.9, top_k=20, seed=100 + i, max_tokens=n, **common)
            for i, n in enumerate(max_tokens)]


class Calls:
    """The runner's launch and finish calls in order, each naming its step by launch number (the
    runner is the engine's collaborator under test for ordering; the steps run for real)."""

    def __init__(self, engine: Engine) -> None:
        self.order: list[tuple[str, int]] = []
        self.launched_with_in_flight = 0
        self.dropped = 0  # launched tokens of requests that had finished by their read-back
        runner = engine.runner
        launch, finish = runner.launch, runner.finish
        steps: list[object] = []  # every launched step, kept (an id() could be reused once freed)

        def number(launched: object) -> int:
            return next(i for i, step in enumerate(steps) if step is launched)

        def recording_launch(chunks, previous):  # type: ignore[no-untyped-def]
            self.launched_with_in_flight += any(c.seq.num_in_flight for c in chunks)
            launched = launch(chunks, previous)
            steps.append(launched)
            self.order.append(("launch", number(launched)))
            return launched

        def recording_finish(launched):  # type: ignore[no-untyped-def]
            self.order.append(("finish", number(launched)))
            self.dropped += sum(c.seq.status == Status.FINISHED for c in launched.chunks)
            return finish(launched)

        runner.launch, runner.finish = recording_launch, recording_finish  # type: ignore[method-assign]

    @property
    def overlapped(self) -> int:
        """Steps read back after the next step was launched."""
        launches = 0
        count = 0
        for kind, number in self.order:
            if kind == "launch":
                launches += 1
            elif launches > number + 1:
                count += 1
        return count


def outputs(outs: list) -> list[tuple[list[int], str]]:  # type: ignore[type-arg]
    return [(o.token_ids, o.finish_reason) for o in outs]


def test_cpu_default_is_synchronous_and_the_option_is_checked(family: Path) -> None:
    assert make(family, None).engine.async_scheduling is False  # type: ignore[arg-type]
    assert make(family, True).engine.async_scheduling is True
    with pytest.raises(ValueError, match="async_scheduling"):
        make(family, "yes")  # type: ignore[arg-type]


def test_pipelined_decode_gives_the_synchronous_tokens(family: Path, rng_seed: int) -> None:
    """A batch with different max_tokens, greedy and seeded random rows, a one-token prompt (its
    first step is a decode) and a request stopped by max_model_len: tokens and finish reasons as
    the synchronous engine's, with most decode steps read back after the next was launched."""
    print(f"seed={rng_seed}")
    sync = make(family, False, max_model_len=40)
    prompts = prompts_of(sync, rng_seed, (3, 9, 1, 14, 30, 6))
    params = mixed_params((12, 7, 20, 15, 25, 1), ignore_eos=True)
    want = outputs(sync.generate(prompts, params, use_tqdm=False))
    assert want[4] == (want[4][0], "length") and len(want[4][0]) == 10  # cut by max_model_len 40
    pipelined = make(family, True, max_model_len=40)
    calls = Calls(pipelined.engine)
    assert outputs(pipelined.generate(prompts, params, use_tqdm=False)) == want
    assert calls.overlapped >= 10 and calls.launched_with_in_flight >= 10, calls.order
    assert calls.dropped == 0  # max_tokens and max_model_len are known when scheduling
    engine = pipelined.engine
    assert engine._launched is None and not engine.scheduler.has_work()
    assert engine.block_manager.num_free == engine.block_manager.num_usable


def test_every_request_is_returned_finished_exactly_once(family: Path, rng_seed: int) -> None:
    """More requests than max_num_seqs: a request finishing at a drained step (one that a newly
    admitted prefill ends) is among the step's returned requests, as the synchronous engine
    returns each request once, when it finishes (LLM.generate's progress counts them)."""
    print(f"seed={rng_seed}")
    for async_on in (False, True):
        llm = make(family, async_on, max_num_seqs=2)
        engine = llm.engine
        prompts = prompts_of(llm, rng_seed, (3, 9, 5, 14, 7, 6, 11))
        requests = list(zip(prompts, mixed_params((5, 2, 8, 3, 6, 4, 2), ignore_eos=True), strict=True))
        seqs = engine.add_requests(requests, None)
        returned: list[Sequence] = []
        while engine.scheduler.has_work():
            for seq in engine.step():
                assert seq.status == Status.FINISHED
                returned.append(seq)
        assert sorted(s.request_id for s in returned) == sorted(s.request_id for s in seqs), async_on


def test_launch_of_the_next_step_comes_before_the_read_back(family: Path, rng_seed: int) -> None:
    """Decode-only steps: launch 0, launch 1, finish 0, launch 2, finish 1, ... (the host
    schedules and fills step N+1 before it waits for step N's tokens)."""
    llm = make(family, True)
    prompts = prompts_of(llm, rng_seed, (1, 1, 1))  # one-token prompts: every step decodes
    calls = Calls(llm.engine)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    # 6 steps; the last one's read-back follows no launch (nothing left to schedule)
    assert calls.order == [("launch", 0), ("launch", 1), ("finish", 0), ("launch", 2), ("finish", 1),
                           ("launch", 3), ("finish", 2), ("launch", 4), ("finish", 3), ("launch", 5),
                           ("finish", 4), ("finish", 5)]


def test_eos_and_stop_tokens_end_the_output_one_step_late_without_leaking(family: Path,
                                                                           rng_seed: int) -> None:
    """An EOS id that occurs in the greedy outputs and per-request stop token ids: the step
    after the stop was already launched; its token is dropped, so outputs end at the stop token
    exactly as the synchronous engine's."""
    print(f"seed={rng_seed}")
    sync = make(family, False)
    prompts = prompts_of(sync, rng_seed, (5, 11, 2, 8, 17))
    free = sync.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                         use_tqdm=False)
    counts: dict[int, int] = {}
    for out in free:
        for token in set(out.token_ids[1:-1]):
            counts[token] = counts.get(token, 0) + 1
    eos = max(counts, key=counts.__getitem__)  # ends several requests early
    stop_tokens = [(out.token_ids[len(out.token_ids) // 2],) for out in free]
    params = [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=stop) if i % 2
              else SamplingParams(temperature=0.0, max_tokens=24) for i, stop in enumerate(stop_tokens)]
    runs = []
    for async_on in (False, True):
        llm = make(family, async_on)
        llm.engine.eos_token_ids = {eos}
        calls = Calls(llm.engine)
        runs.append(outputs(llm.generate(prompts, params, use_tqdm=False)))
    assert runs[1] == runs[0]
    assert calls.dropped >= 1  # a stop read back after the request's next step was launched
    assert sum(reason == "stop" for _, reason in runs[0]) >= 2, runs[0]
    for (tokens, reason), p in zip(runs[1], params, strict=True):
        if reason == "stop":
            assert tokens[-1] in {eos, *p.stop_token_ids}
            assert not {eos, *p.stop_token_ids} & set(tokens[:-1])


def test_a_stop_string_ends_the_text_as_the_synchronous_engine(rng_seed: int) -> None:
    """The embedded default model (it has a tokenizer): a stop string from the middle of one
    request's greedy text, beside requests that keep decoding."""
    from jackfield.models.default_model import default_model_dir

    directory = default_model_dir()
    sync = make(directory, False, backend="auto")
    prompts = ["The quick brown fox", "Once upon a time", "1, 2, 3,"]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    full = sync.generate(prompts, greedy, use_tqdm=False)[0]
    assert full.text is not None and len(full.text) > 12
    starts = [i for i in range(2, len(full.text) - 3) if "\ufffd" not in full.text[i : i + 3]]
    stop = full.text[starts[rng_seed % len(starts)] :][:3]
    print(f"seed={rng_seed} stop={stop!r}")
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop]), greedy, greedy]
    want = sync.generate(prompts, params, use_tqdm=False)
    got = make(directory, True, backend="auto").generate(prompts, params, use_tqdm=False)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [
        (o.token_ids, o.text, o.finish_reason) for o in want]
    assert got[0].finish_reason == "stop" and got[0].text == full.text[: full.text.index(stop)]


def run_steps(engine: Engine, arrivals: dict[int, list[tuple[list[int], SamplingParams]]],
              abort_at: int | None = None) -> tuple[list[Sequence], list[Sequence]]:
    """Step until idle, adding arrivals[k] before step k (and at once if idle); abort_at: from
    that step on, abort the first decoding request that has a token in flight (synchronously:
    the first decoding one). Returns (requests in arrival order, the aborted ones)."""
    seqs: list[Sequence] = []
    aborted: list[Sequence] = []
    step = 0
    pending = dict(arrivals)
    while pending or engine.scheduler.has_work():
        if step in pending or (pending and not engine.scheduler.has_work()):
            seqs += engine.add_requests(pending.pop(step if step in pending else min(pending)))
        if abort_at is not None and step >= abort_at and not aborted:
            decoding = [s for s in engine.scheduler.running if s.num_computed > s.prompt_len
                        and (s.num_in_flight or not engine.async_scheduling)]
            if decoding:
                engine.abort(decoding[0])
                aborted.append(decoding[0])
        engine.step()
        step += 1
    return seqs, aborted


def test_arrivals_while_others_decode_and_an_abort_with_a_token_in_flight(family: Path,
                                                                          rng_seed: int) -> None:
    """Requests arrive while others decode with tokens in flight (each admission drains the
    pipeline for one synchronous step with the new prefill); one is aborted with its token in
    flight. The others' tokens are the synchronous engine's; the aborted one's output is a
    prefix of its own; every block is free at the end and nothing is left in flight."""
    print(f"seed={rng_seed}")
    runs = []
    for async_on in (False, True):
        llm = make(family, async_on, max_num_batched_tokens=16)
        prompts = prompts_of(llm, rng_seed, (4, 7, 13, 3, 21, 5))
        params = mixed_params((14, 9, 12, 16, 8, 11), ignore_eos=True)
        requests = list(zip(prompts, params, strict=True))
        arrivals = {0: requests[:2], 3: requests[2:4], 6: requests[4:]}
        seqs, aborted = run_steps(llm.engine, arrivals, abort_at=5)
        engine = llm.engine
        assert engine._launched is None and all(s.num_in_flight == 0 for s in seqs)
        assert engine.block_manager.num_free == engine.block_manager.num_usable
        runs.append((seqs, aborted))
    (sync, sync_aborted), (pipelined, pipelined_aborted) = runs
    assert [s.finish_reason for s in pipelined_aborted] == ["abort"] and len(sync_aborted) == 1
    for want, got in zip(sync, pipelined, strict=True):
        if got in pipelined_aborted or want in sync_aborted:  # both cut short, or one
            short, long = sorted((want.output_ids, got.output_ids), key=len)
            assert long[: len(short)] == short
        else:
            assert (got.output_ids, got.finish_reason) == (want.output_ids, want.finish_reason)


def test_the_async_server_loop_gives_the_synchronous_tokens(family: Path, rng_seed: int) -> None:
    """AsyncEngine (the server's loop over Engine.step): requests submitted while others stream."""
    from jackfield.engine.async_engine import AsyncEngine

    sync = make(family, False)
    prompts = prompts_of(sync, rng_seed, (6, 2, 11, 9))
    params = mixed_params((10, 14, 6, 12), ignore_eos=True)
    want = [o.token_ids for o in sync.generate(prompts, params, use_tqdm=False)]
    server = AsyncEngine(make(family, True).engine)
    got: list[list[int]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    first_tokens = threading.Event()

    def deliver_to(i: int):  # type: ignore[no-untyped-def]
        def deliver(delta) -> None:  # type: ignore[no-untyped-def]
            got[i] += delta.token_ids
            first_tokens.set()
            if delta.finished:
                done[i].set()
        return deliver

    try:
        for i in (0, 1):
            server.submit(prompts[i], params[i], deliver_to(i))
        assert first_tokens.wait(60)
        for i in (2, 3):  # while the first two decode
            server.submit(prompts[i], params[i], deliver_to(i))
        assert all(event.wait(120) for event in done)
    finally:
        server.shutdown()
    assert got == want


def test_prefix_cache_state_is_the_synchronous_engines(family: Path, rng_seed: int) -> None:
    """Prefix caching on, shared prefixes, requests stopped by stop tokens on the token that
    completes a block (a step late, the next step already computing past it): the cached block
    hashes, the prefix hits and the tokens are the synchronous engine's, over two calls (the
    second served from the first's blocks)."""
    print(f"seed={rng_seed}")
    probe = make(family, False)
    shared = prompts_of(probe, rng_seed, (9,))[0]
    tails = prompts_of(probe, rng_seed + 1, (2, 5, 1, 7, 3, 6))
    prompts = [shared + tail for tail in tails]
    free = probe.generate(prompts, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
                          use_tqdm=False)
    params = []
    for prompt, out in zip(prompts, free, strict=True):
        # the first new token that fills a block and occurs nowhere before it in the output
        fills = [k for k, t in enumerate(out.token_ids) if (len(prompt) + k + 1) % BLOCK == 0
                 and t not in out.token_ids[:k]]
        stop = (out.token_ids[fills[0]],) if fills else ()
        params.append(SamplingParams(temperature=0.0, max_tokens=14, stop_token_ids=stop))
    runs = []
    for async_on in (False, True):
        llm = make(family, async_on, enable_prefix_caching=True)
        first = outputs(llm.generate(prompts[:3], params[:3], use_tqdm=False))
        state = set(llm.engine.block_manager.cached)
        second = llm.generate(prompts[3:] + prompts[:1], params[3:] + params[:1], use_tqdm=False)
        runs.append((first, state, outputs(second), [o.num_cached_tokens for o in second],
                     set(llm.engine.block_manager.cached)))
    assert runs[1] == runs[0]
    assert sum(reason == "stop" for _, reason in runs[0][0] + runs[0][2]) >= 3
    assert any(runs[0][3]) and len(runs[0][4]) > len(runs[0][1])


def test_preemption_under_a_small_kv_budget(rng_seed: int, tmp_path: Path) -> None:
    """DeepSeek-V3 (torch_ref MLA) with 9 blocks of 16 for three requests that need 12: requests
    are preempted while their token is in flight (appended when read back, recomputed with the
    rest); the tokens are the synchronous engine's under the same budget and under a roomy one."""
    print(f"seed={rng_seed}")
    write_deepseek("v3", tmp_path, seed=3)
    # 3 layers x 16 slots x 40 floats x 4 B = 7680 B per block
    tight = {"block_size": 16, "cpu_kv_cache_gib": 9 * 7680 / 2**30}
    roomy = make(tmp_path, False, block_size=16)
    prompts = prompts_of(roomy, rng_seed, (20, 24, 28))
    params = mixed_params((24, 22, 24), ignore_eos=True)
    want = outputs(roomy.generate(prompts, params, use_tqdm=False))
    squeezed = make(tmp_path, False, **tight).generate(prompts, params, use_tqdm=False)
    assert outputs(squeezed) == want and sum(o.num_preemptions for o in squeezed) > 0
    llm = make(tmp_path, True, **tight)
    assert llm.engine.runner.kv.num_blocks == 9
    in_flight_at_preemption = []
    preempt = llm.engine.scheduler._preempt

    def recording_preempt(seq: Sequence) -> None:
        in_flight_at_preemption.append(seq.num_in_flight)
        preempt(seq)

    llm.engine.scheduler._preempt = recording_preempt  # type: ignore[method-assign]
    assert outputs(llm.generate(prompts, params, use_tqdm=False)) == want
    assert any(in_flight_at_preemption), in_flight_at_preemption


def test_steps_that_read_the_tokens_on_the_host_run_synchronously(family: Path, rng_seed: int) -> None:
    """Penalties and logprobs need each step's tokens on the host: such steps are never
    launched, and their requests' tokens and logprobs are the synchronous engine's; a batch
    mixing them with plain requests runs synchronously throughout."""
    sync = make(family, False)
    prompts = prompts_of(sync, rng_seed, (5, 8, 3))
    params = [SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    want = sync.generate(prompts, params, use_tqdm=False)
    llm = make(family, True)
    calls = Calls(llm.engine)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert calls.order == []
    assert outputs(got) == outputs(want)
    assert got[1].outputs[0].logprobs == want[1].outputs[0].logprobs


def test_decode_graph_fill_takes_the_in_flight_tokens(tmp_path: Path, rng_seed: int) -> None:
    """Granite SWA (several KV cache groups) through the decode graphs' static buffers on the CPU
    (record=False: the replay's data flow, without recording): the pipelined steps write the
    in-flight tokens into the graphs' input ids on the device and give the tokens of the same
    buffers run synchronously. (torch_ref's decode over the capture-time metadata is not the
    eager step's for this family, so the reference is the synchronous replay path.)"""
    from jackfield.engine.cuda_graphs import DecodeGraphs

    print(f"seed={rng_seed}")
    write_granite("granite_swa", tmp_path / "swa", seed=2)
    runs: list[list[bool]] = []
    results = []
    for async_on in (False, True):
        llm = make(tmp_path / "swa", async_on)
        engine, runner = llm.engine, llm.engine.runner
        graphs = DecodeGraphs(engine.model, runner.kv_caches, runner.kv_scales, runner.contexts,
                              runner.block_tables, runner.kv.num_blocks, runner.block_size,
                              engine.max_model_len, 8, engine.device, record=False)
        graphs.capture()
        replays: list[bool] = []
        run = graphs.run

        def counted_run(chunks, q, taps=None, in_flight=None, replays=replays, run=run):  # type: ignore[no-untyped-def]
            replays.append(in_flight is not None)
            return run(chunks, q, taps, in_flight)

        graphs.run = counted_run  # type: ignore[method-assign]
        runner.graphs = graphs
        prompts = prompts_of(llm, rng_seed, (3, 9, 14, 1))
        results.append(outputs(llm.generate(prompts, mixed_params((12, 9, 15, 10), ignore_eos=True),
                                            use_tqdm=False)))
        runs.append(replays)
    assert results[1] == results[0]
    assert len(runs[0]) >= 10 and not any(runs[0])  # replayed synchronously
    assert sum(runs[1]) >= 8, runs[1]  # replayed with the previous step's tokens on the device


@pytest.mark.parametrize("failing", ["launch", "finish"])
def test_a_failed_pipelined_step_leaves_the_engine_serving(family: Path, failing: str, rng_seed: int) -> None:
    """A launch (the device step) or a read-back (e.g. no finite logit) fails mid-run with a
    step in flight: the call raises, its requests are aborted with nothing left in flight and
    every block free, and the next call gives the first call's tokens."""
    llm = make(family, True)
    prompts = prompts_of(llm, rng_seed, (4, 10, 7))
    params = mixed_params((9, 12, 10), ignore_eos=True)
    want = outputs(llm.generate(prompts, params, use_tqdm=False))
    runner = llm.engine.runner
    working = getattr(runner, failing)
    calls = 0

    def fails_on_the_fourth(*args):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 4:
            raise RuntimeError("device step failed")
        return working(*args)

    setattr(runner, failing, fails_on_the_fourth)
    with pytest.raises(RuntimeError, match="device step failed"):
        llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert engine._launched is None and not engine.scheduler.has_work()
    assert engine.block_manager.num_free == engine.block_manager.num_usable
    setattr(runner, failing, working)
    assert outputs(llm.generate(prompts, params, use_tqdm=False)) == want

"""`jackfield serve --pd`: the HTTP server over a prefill/decode pair (`PDLLM` driving the
`AsyncEngine` loop). Concurrent completions give one engine's tokens while the prompts' blocks
come from the prefill engine; a request aborted while at the prefill engine finishes as aborted
and the pair keeps serving. Every wait is bounded (a hung server fails the test, never the run)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.commands.pd import PDLLM
from jackfield.engine.async_engine import AsyncEngine, RequestDelta
from jackfield.models.default_model import default_model_dir

httpx = pytest.importorskip("httpx", reason="jackfield[serve] is not installed")
uvicorn = pytest.importorskip("uvicorn", reason="jackfield[serve] is not installed")
from jackfield.serving.app import create_app  # noqa: E402  (it imports the serve extra's packages)

BASE = {"engine.device": "cpu", "attention.backend": "torch_ref", "model.dtype": "float32",
        "engine.block_size": 16, "engine.max_num_seqs": 4}
TIMEOUT_S = 120
LENGTHS = (40, 67, 16, 3)  # whole blocks and a remainder, one block, under a block


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, AsyncEngine, PDLLM]]:
    """(base URL, the loop, the pair): uvicorn on a free 127.0.0.1 port in a thread."""
    pair = PDLLM(str(default_model_dir()), **BASE, **{"kv_connector.options": {"timeout_s": 10.0}})
    async_engine = AsyncEngine(pair.engine, pair)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(async_engine, "tiny"), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", async_engine, pair
    finally:
        server.should_exit = True
        thread.join(30)
        async_engine.shutdown()
        pair.close()
    assert not thread.is_alive(), "the server did not stop"


def _prompts(seed: int, vocab: int) -> list[list[int]]:
    print(f"seed={seed}")
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def test_concurrent_completions_are_one_engines_and_prompts_come_from_the_prefill_engine(
    served: tuple[str, AsyncEngine, PDLLM], rng_seed: int
) -> None:
    url, async_engine, pair = served
    prompts = _prompts(rng_seed, pair.engine.capabilities.vocab_size)
    before = pair.producer_stats()
    assert before is not None

    def complete(prompt: list[int]) -> list[int]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:  # arriving together: they share steps
        got = list(pool.map(complete, prompts))
    single = LLM(str(default_model_dir()), **BASE)
    want = single.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)
    assert got == [o.token_ids for o in want]
    after = pair.producer_stats()
    assert after is not None and pair.producer_error is None
    # every prompt was prefilled there and sent its whole blocks (40: 2, 67: 4, 16: 1, 3: none)
    assert after["exported_requests"] - before["exported_requests"] == len(prompts)
    assert after["exported_blocks"] - before["exported_blocks"] == 7
    assert async_engine.finish_reasons["length"] >= len(prompts)


def test_a_request_aborted_at_the_prefill_engine_ends_and_the_pair_keeps_serving(
    served: tuple[str, AsyncEngine, PDLLM], rng_seed: int
) -> None:
    """Through the loop: a request aborted right after it was submitted finishes as aborted (at
    whichever engine the abort finds it) and the next request gets one engine's tokens. Then
    directly, while the loop is idle: an abort that finds the request at the prefill engine ends
    it there, and its handoff, when it comes, is dropped."""
    _, async_engine, pair = served
    prompts = _prompts(rng_seed, pair.engine.capabilities.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    deltas: dict[int, list[RequestDelta]] = {0: [], 1: []}
    done = {0: threading.Event(), 1: threading.Event()}

    def deliver(index: int) -> Callable[[RequestDelta], None]:  # the loop thread calls it
        def take(delta: RequestDelta) -> None:
            deltas[index].append(delta)
            if delta.finished:
                done[index].set()
        return take

    async_engine.abort(async_engine.submit(prompts[1], params, deliver(0)))
    assert done[0].wait(TIMEOUT_S), "the aborted request never finished"
    assert deltas[0][-1].finish_reason == "abort"
    assert sum(len(d.token_ids) for d in deltas[0]) < params.max_tokens
    async_engine.submit(prompts[0], params, deliver(1))
    assert done[1].wait(TIMEOUT_S), "the pair stopped serving after an abort"
    want = LLM(str(default_model_dir()), **BASE).generate(prompts[:2], params, use_tqdm=False)
    assert [t for d in deltas[1] for t in d.token_ids] == want[0].token_ids

    assert async_engine.num_active == 0  # the loop waits for work: this thread may step the pair
    exported = (pair.producer_stats() or {})["exported_requests"]
    seq = pair.add_request(prompts[1], params)
    pair.abort(seq)
    assert seq.finish_reason == "abort" and not pair.has_work()
    deadline = time.monotonic() + TIMEOUT_S
    while (pair.producer_stats() or {})["exported_requests"] == exported:  # its prefill runs there
        assert time.monotonic() < deadline, "the prefill engine never ran the aborted request"
        time.sleep(0.05)
    assert pair.step() == [] and not pair.has_work()  # its handoff (already sent) went nowhere
    assert seq.output_ids == [] and pair.producer_error is None
    again = pair.generate([prompts[1]], params, use_tqdm=False)[0]
    assert again.token_ids == want[1].token_ids

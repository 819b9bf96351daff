"""`jackfield serve` on 127.0.0.1, driven by the official `openai` client: completions and chat,
streamed and not, equal to the offline engine's greedy output; 64 concurrent streams each equal
to the request run alone; a client that disconnects frees its KV; bad requests get 400s naming
the field. Every wait is bounded (a hung server fails the test, never the run)."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from jackfield import LLM, SamplingParams
from jackfield.engine.async_engine import AsyncEngine
from jackfield.models.default_model import default_model_dir
from jackfield.serving.app import create_app

NAME = "tiny"
# ChatML, as SmolLM2's tokenizer_config.json has it
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("serve") / "model"
    shutil.copytree(default_model_dir(), directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return directory


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> LLM:
    return LLM(str(model_dir), device="cpu")


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[tuple[str, AsyncEngine]]:
    """(base URL, its engine): uvicorn on a free 127.0.0.1 port in a thread."""
    from jackfield.config import resolve_config
    from jackfield.engine.engine import Engine

    async_engine = AsyncEngine(
        Engine(resolve_config(None, str(model_dir), {"engine.device": "cpu"}), lambda _: None)
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(async_engine, NAME), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", async_engine
    server.should_exit = True
    thread.join(30)
    async_engine.shutdown()
    assert not thread.is_alive(), "the server did not stop"


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)


def prompts(offline: LLM) -> list[str]:
    """Prompts as text that round-trips through the tokenizer (so both sides see the same ids)."""
    tok = offline.tokenizer
    return [
        tok.decode(tok.encode(t, add_special_tokens=False))
        for t in ("The quick brown fox", "Jackfield is", "1 2 3")
    ]


def offline_text(offline: LLM, prompt: str | list[int], max_tokens: int) -> str:
    out = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[
        0
    ]
    assert out.text is not None
    return out.text


def test_completions_equal_the_offline_engine(server: tuple[str, AsyncEngine], offline: LLM) -> None:
    url, _ = server
    for prompt in prompts(offline):
        got = client(url).completions.create(
            model=NAME, prompt=prompt, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True}
        )
        assert got.choices[0].text == offline_text(offline, prompt, 12)
        assert got.choices[0].finish_reason == "length"
        assert got.usage.completion_tokens == 12
        assert got.usage.prompt_tokens == len(offline.tokenizer.encode(prompt, add_special_tokens=False))


def test_streamed_text_is_the_whole_text_and_usage_comes_last(
    server: tuple[str, AsyncEngine], offline: LLM
) -> None:
    url, _ = server
    prompt = prompts(offline)[0]
    chunks = list(
        client(url).completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=10,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == offline_text(offline, prompt, 10)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_uses_the_models_template(server: tuple[str, AsyncEngine], offline: LLM) -> None:
    url, _ = server
    messages = [{"role": "user", "content": "Hello there"}]
    ids = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    want = offline_text(offline, list(ids), 8)
    got = client(url).chat.completions.create(
        model=NAME, messages=messages, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want
    streamed = client(url).chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=8,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == want


def test_a_stop_string_ends_the_text_before_it(server: tuple[str, AsyncEngine], offline: LLM) -> None:
    url, _ = server
    prompt = prompts(offline)[1]
    full = offline_text(offline, prompt, 16)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"pick another prompt: {full!r}"
    got = client(url).completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=16,
        temperature=0.0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].text == full[: full.index(stop)]
    assert got.choices[0].finish_reason == "stop"


def test_64_concurrent_streams_each_equal_the_request_alone(
    server: tuple[str, AsyncEngine], offline: LLM
) -> None:
    url, async_engine = server
    texts = [f"{w} {i}" for i, w in enumerate(["alpha", "beta", "gamma", "delta"] * 16)]
    lengths = [4 + i % 9 for i in range(len(texts))]
    ids = [offline.tokenizer.encode(t, add_special_tokens=False) for t in texts]

    async def one(aclient: openai.AsyncOpenAI, prompt: list[int], n: int) -> str:
        stream = await aclient.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=n,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].text async for c in stream])

    async def everyone() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)
        return await asyncio.wait_for(
            asyncio.gather(*(one(aclient, p, n) for p, n in zip(ids, lengths, strict=True))), TIMEOUT_S
        )

    got = asyncio.run(everyone())
    for prompt, n, text in zip(ids, lengths, got, strict=True):
        assert text == offline_text(offline, prompt, n)
    assert async_engine.num_active == 0


def test_a_client_that_disconnects_frees_its_kv(server: tuple[str, AsyncEngine], offline: LLM) -> None:
    """The request could run to max_model_len; it is aborted instead (the loop counts it so)."""
    url, async_engine = server
    blocks = async_engine.engine.block_manager
    free_before, aborted_before = blocks.num_free, async_engine.finish_reasons["abort"]
    prompt = prompts(offline)[0]
    room = (
        async_engine.engine.max_model_len
        - len(offline.tokenizer.encode(prompt, add_special_tokens=False))
        - 1
    )
    body = {
        "model": NAME,
        "prompt": prompt,
        "max_tokens": room,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as response:
        first = next(response.iter_lines())
        assert first.startswith("data: ")
    deadline = time.monotonic() + TIMEOUT_S
    while async_engine.num_active or blocks.num_free < free_before:
        assert time.monotonic() < deadline, "the disconnected request still holds its blocks"
        time.sleep(0.05)
    assert async_engine.finish_reasons["abort"] == aborted_before + 1


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
        ("/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
            400,
            "top_logprobs",
        ),
    ],
)
def test_bad_requests_are_refused_naming_the_field(
    server: tuple[str, AsyncEngine], path: str, body: dict[str, object], status: int, param: str
) -> None:
    url, async_engine = server
    response = httpx.post(f"{url}{path}", json={"model": NAME, **body}, timeout=TIMEOUT_S)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert async_engine.num_active == 0


def test_invalid_json_and_the_small_endpoints(server: tuple[str, AsyncEngine], offline: LLM) -> None:
    url, async_engine = server
    bad = httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=TIMEOUT_S)
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    assert httpx.get(f"{url}/health", timeout=TIMEOUT_S).json() == {"status": "ok"}
    models = client(url).models.list()
    assert [m.id for m in models.data] == [NAME]
    text = prompts(offline)[0]
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=TIMEOUT_S).json()
    assert tokens["tokens"] == offline.tokenizer.encode(text, add_special_tokens=False)
    back = httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}, timeout=TIMEOUT_S).json()
    assert back["prompt"] == text
    metrics = httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text
    assert "jackfield_generation_tokens_total" in metrics
    assert f"jackfield_kv_blocks_free {async_engine.engine.block_manager.num_free}" in metrics


def test_n_samples_logprobs_and_penalties_equal_the_offline_engine(
    server: tuple[str, AsyncEngine], offline: LLM, rng_seed: int
) -> None:
    url, _ = server
    prompt = prompts(offline)[1]
    seed = rng_seed % 10_000
    got = client(url).completions.create(
        model=NAME, prompt=prompt, max_tokens=6, temperature=0.8, n=2, seed=seed, logprobs=2,
        presence_penalty=0.5, extra_body={"ignore_eos": True, "repetition_penalty": 1.3}
    )
    assert [c.index for c in got.choices] == [0, 1]
    for choice, sample_seed in zip(got.choices, (seed, seed + 1), strict=True):
        want = offline.generate([prompt], SamplingParams(
            temperature=0.8, seed=sample_seed, max_tokens=6, logprobs=2, ignore_eos=True,
            presence_penalty=0.5, repetition_penalty=1.3), use_tqdm=False)[0]
        assert choice.text == want.text
        assert want.logprobs is not None and choice.logprobs is not None
        assert choice.logprobs.token_logprobs == pytest.approx(
            [top[t] for t, top in zip(want.token_ids, want.logprobs, strict=True)], abs=1e-5)
        for got_top, want_top in zip(choice.logprobs.top_logprobs, want.logprobs, strict=True):
            assert 2 <= len(want_top) <= 3  # the top 2 and the sampled token (keyed by its text here)
            assert set(got_top) == {offline.tokenizer.decode([t]) for t in want_top}
        assert choice.logprobs.tokens == [offline.tokenizer.decode([t]) for t in want.token_ids]
    assert got.usage.completion_tokens == 12 and got.usage.prompt_tokens == len(
        offline.tokenizer.encode(prompt, add_special_tokens=False))


def test_chat_logprobs_give_each_tokens_top_k(server: tuple[str, AsyncEngine], offline: LLM) -> None:
    url, _ = server
    messages = [{"role": "user", "content": "Hello there"}]
    got = client(url).chat.completions.create(
        model=NAME, messages=messages, max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True}
    )
    want = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True),
                        use_tqdm=False)[0]
    content = got.choices[0].logprobs.content
    assert want.logprobs is not None and len(content) == 5
    for entry, token, top in zip(content, want.token_ids, want.logprobs, strict=True):
        assert entry.token == offline.tokenizer.decode([token])
        assert entry.logprob == pytest.approx(top[token], abs=1e-5)
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx(list(top.values())[:3], abs=1e-5)
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the token is the most likely


def test_streaming_several_prompts_with_n_gives_every_choice(server: tuple[str, AsyncEngine],
                                                           offline: LLM) -> None:
    url, _ = server
    batch = prompts(offline)[:2]
    chunks = list(client(url).completions.create(
        model=NAME, prompt=batch, max_tokens=5, temperature=0.7, n=2, seed=3, stream=True,
        extra_body={"ignore_eos": True}
    ))
    texts = ["", "", "", ""]
    reasons: list[str | None] = [None] * 4
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    for index, text in enumerate(texts):  # choice i * n + j: prompt i, sample j (seed 3 + j)
        want = offline.generate([batch[index // 2]], SamplingParams(
            temperature=0.7, seed=3 + index % 2, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
        assert text == want.text
    assert reasons == ["length"] * 4


def test_metrics_report_latency_histograms(server: tuple[str, AsyncEngine], offline: LLM) -> None:
    url, _ = server
    client(url).completions.create(model=NAME, prompt=prompts(offline)[2], max_tokens=4, temperature=0.0,
                                   extra_body={"ignore_eos": True})
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    for name in ("jackfield_time_to_first_token_seconds", "jackfield_inter_token_latency_seconds"):
        count = int(values[f"{name}_count"])
        assert count > 0 and int(values[f'{name}_bucket{{le="+Inf"}}']) == count
        assert float(values[f"{name}_sum"]) > 0
        buckets = [int(v) for k, v in values.items() if k.startswith(f"{name}_bucket")]
        assert buckets == sorted(buckets)  # cumulative
    assert 0.0 <= float(values["jackfield_kv_cache_usage"]) <= 1.0


def test_metrics_report_speculative_acceptance(model_dir: Path) -> None:
    """With a drafter the counters appear and add up to the engine's own per-request stats."""
    from fastapi.testclient import TestClient
    from jackfield.config import resolve_config
    from jackfield.engine.engine import Engine

    overrides = {"engine.device": "cpu", "speculative.method": "ngram",
                 "speculative.num_speculative_tokens": 2, "speculative.prompt_lookup_min": 1}
    async_engine = AsyncEngine(Engine(resolve_config(None, str(model_dir), overrides), lambda _: None))
    try:
        with TestClient(create_app(async_engine, NAME)) as http:
            body = {"prompt": [7, 8, 9] * 6, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
            assert http.post("/v1/completions", json=body, timeout=TIMEOUT_S).status_code == 200
            text = http.get("/metrics", timeout=TIMEOUT_S).text
    finally:
        async_engine.shutdown()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    spec = async_engine.speculative
    assert spec.draft_tokens > 0
    assert int(values["jackfield_spec_decode_draft_tokens_total"]) == spec.draft_tokens
    assert int(values["jackfield_spec_decode_accepted_tokens_total"]) == spec.accepted_tokens
    assert int(values["jackfield_spec_decode_drafts_total"]) == spec.drafts


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_are_the_offline_engines(server: tuple[str, AsyncEngine], offline: LLM,
                                                 stream: bool) -> None:
    url, _ = server
    prompt = prompts(offline)[0]
    body = {"model": NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0.0, "prompt_logprobs": 2,
            "stream": stream}
    want = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2),
                            use_tqdm=False)[0].prompt_logprobs
    if stream:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: {")]
        got = [c["prompt_logprobs"] for e in events for c in e["choices"] if "prompt_logprobs" in c]
        assert len(got) == 1  # once, with the choice's first chunk
        got = got[0]
    else:
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S).json()["choices"][0][
            "prompt_logprobs"]
    assert want is not None and got[0] is None and len(got) == len(want)
    for entry, expected in zip(got[1:], want[1:], strict=True):
        assert {int(t): v["logprob"] for t, v in entry.items()} == pytest.approx(expected, abs=1e-5)
        assert all(v["decoded_token"] == offline.tokenizer.decode([int(t)]) for t, v in entry.items())

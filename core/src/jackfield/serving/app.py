"""`jackfield serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over one AsyncEngine.

Endpoints: /v1/completions, /v1/chat/completions (streamed as server-sent events when asked),
/v1/models, /health, /tokenize, /detokenize, /metrics (Prometheus text). Every request runs in the
one engine loop, so concurrent HTTP requests share steps. A client that disconnects aborts its
request (its KV blocks are freed at the next step). docs/serving.md lists fields and limits.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from transformers import PreTrainedTokenizerBase

from jackfield.engine.async_engine import AsyncEngine, RequestDelta, RequestStream
from jackfield.engine.tokenizer import chat_prompt_ids
from jackfield.serving.metrics import ServerMetrics
from jackfield.serving.protocol import GenerationRequest, RequestError, field_named, parse_generation


@dataclass
class TextState:
    """Incremental text of one completion: decoded whole each time (a token may complete a
    multi-byte character of the one before). The engine finds stop strings (SamplingParams.stop)
    and says where the text ends; this only holds back what could still become one."""

    tokenizer: PreTrainedTokenizerBase
    stops: tuple[str, ...]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # sent so far

    def add(self, delta: RequestDelta) -> str:
        """The new text of the delta's tokens (held back while it ends in a partial character or
        could be the start of a stop string, unless the delta is the last)."""
        self.token_ids += delta.token_ids
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if delta.text_end is not None:  # a stop string begins there: it and what follows go
            full = full[: delta.text_end]
        if not delta.finished:
            hold = max((len(s) - 1 for s in self.stops), default=0)
            end = len(full) - hold if hold else len(full)
            while end > len(self.text) and full[end - 1] == "\ufffd":
                end -= 1
            full = full[: max(end, len(self.text))]
        new, self.text = full[len(self.text) :], full
        return new


@dataclass
class Choice:
    """One choice of a response (a prompt's sample): its stream and what it produced so far."""

    index: int
    stream: RequestStream
    text: TextState | None  # None: the model has no tokenizer (token ids only)
    submitted: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    last_token_time: float | None = None
    text_offset: int = 0  # completions' logprobs: where the next token's text starts


def create_app(async_engine: AsyncEngine, model_name: str) -> FastAPI:
    engine = async_engine.engine
    tokenizer = engine.tokenizer
    metrics_state = ServerMetrics()
    app = FastAPI(title="Jackfield", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestError)
    async def request_error(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "jackfield",
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, object]:
        body = await _json(request)
        ids = _chat_ids(body) if "messages" in body else _prompt_ids(body.get("prompt"))[0]
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, object]:
        body = await _json(request)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError("tokens must be a list of token ids", "tokens")
        return {"prompt": _tokenizer().decode(ids)}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        blocks = engine.block_manager
        reasons = {"stop": 0, "length": 0, "abort": 0, "error": 0, **async_engine.finish_reasons}
        lines = ["# TYPE jackfield_requests_total counter"]
        lines += [f'jackfield_requests_total{{finish_reason="{k}"}} {v}' for k, v in sorted(reasons.items())]
        lines += [
            "# TYPE jackfield_prompt_tokens_total counter",
            f"jackfield_prompt_tokens_total {metrics_state.prompt_tokens}",
            "# TYPE jackfield_generation_tokens_total counter",
            f"jackfield_generation_tokens_total {metrics_state.generation_tokens}",
            "# TYPE jackfield_requests_running gauge",
            f"jackfield_requests_running {len(engine.scheduler.running)}",
            "# TYPE jackfield_requests_waiting gauge",
            f"jackfield_requests_waiting {len(engine.scheduler.waiting)}",
            "# TYPE jackfield_kv_blocks_free gauge",
            f"jackfield_kv_blocks_free {blocks.num_free}",
            "# TYPE jackfield_kv_blocks_total gauge",
            f"jackfield_kv_blocks_total {blocks.num_usable}",
            "# TYPE jackfield_kv_cache_usage gauge",
            f"jackfield_kv_cache_usage {1 - blocks.num_free / blocks.num_usable:.6f}",
        ]
        lines += metrics_state.time_to_first_token.lines(
            "jackfield_time_to_first_token_seconds", "submission to the first token, per request")
        lines += metrics_state.inter_token_latency.lines(
            "jackfield_inter_token_latency_seconds", "time between a request's tokens, per token")
        if engine.drafter is not None:
            spec = async_engine.speculative
            lines += [f"# TYPE jackfield_spec_decode_{name}_total counter\n"
                      f"jackfield_spec_decode_{name}_total {value}"
                      for name, value in (("drafts", spec.drafts), ("draft_tokens", spec.draft_tokens),
                                          ("accepted_tokens", spec.accepted_tokens))]
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.post("/v1/completions")
    async def completions(request: Request) -> object:
        body = await _json(request)
        _check_model(body)
        prompts = _prompt_ids(body.get("prompt"))
        room = engine.max_model_len - max(len(p) for p in prompts)
        gen = parse_generation(body, default_max_tokens=16, max_room=room, chat=False)
        return await _respond(request, prompts, gen, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> object:
        body = await _json(request)
        _check_model(body)
        ids = _chat_ids(body)
        gen = parse_generation(
            body, default_max_tokens=None, max_room=engine.max_model_len - len(ids) - 1, chat=True
        )
        return await _respond(request, [ids], gen, chat=True)

    # ---- helpers -------------------------------------------------------------------------------
    def _tokenizer() -> PreTrainedTokenizerBase:
        if tokenizer is None:
            raise RequestError(f"{engine.model_dir} has no tokenizer: send prompts as token ids")
        return tokenizer

    def _check_model(body: Mapping[str, object]) -> None:
        if body.get("model") not in (None, model_name):
            raise RequestError(
                f"The model `{body.get('model')}` does not exist; this server serves `{model_name}`",
                "model",
                status=404,
            )

    def _prompt_ids(prompt: object) -> list[list[int]]:
        """A string, a list of token ids, or a list of either: one token-id list per prompt."""

        def one(p: object) -> list[int] | None:
            if isinstance(p, str):
                return list(_tokenizer().encode(p, add_special_tokens=False))
            if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                return p
            return None

        single = one(prompt)
        if single is not None:
            return [single]
        many = [one(p) for p in prompt] if isinstance(prompt, list) and prompt else [None]
        if any(p is None for p in many):
            raise RequestError("prompt must be a string, a list of token ids, or a list of either", "prompt")
        return many  # type: ignore[return-value]

    def _chat_ids(body: Mapping[str, object]) -> list[int]:
        try:
            return chat_prompt_ids(tokenizer, engine.model_dir, body.get("messages"))
        except ValueError as exc:
            raise RequestError(str(exc), "messages") from None

    async def _respond(
        request: Request, prompts: list[list[int]], gen: GenerationRequest, chat: bool
    ) -> object:
        """Submit every (prompt, sample) pair, then answer whole or as server-sent events. Choice
        i * n + j is prompt i's sample j (vLLM's order)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, RequestDelta]] = asyncio.Queue()
        samples = gen.params.per_sample()
        choices: list[Choice] = []
        try:
            for ids in prompts:
                for params in samples:
                    index = len(choices)
                    stream = async_engine.submit(
                        ids, params, lambda d, i=index: loop.call_soon_threadsafe(queue.put_nowait, (i, d))
                    )
                    text = TextState(tokenizer, params.stop) if tokenizer is not None else None
                    choices.append(Choice(index, stream, text, time.perf_counter()))
        except ValueError as exc:
            for choice in choices:
                async_engine.abort(choice.stream)
            raise RequestError(str(exc), field_named(str(exc)) or "prompt") from None
        metrics_state.prompt_tokens += sum(map(len, prompts))
        response = Response(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time()),
                            model_name, chat, sum(map(len, prompts)), gen)
        if gen.stream:
            return StreamingResponse(_stream(choices, queue, response), media_type="text/event-stream")
        async for _ in _events(choices, queue):
            pass
        return {
            **response.header(),
            "choices": [
                {
                    "index": c.index,
                    "finish_reason": c.finish_reason,
                    "logprobs": _logprobs(c, c.token_ids, c.logprobs, gen, chat),
                    **_prompt_logprobs(c.prompt_logprobs),
                    "token_ids": c.token_ids,
                    **({"message": {"role": "assistant", "content": _text(c)}}
                       if chat else {"text": _text(c)}),
                }
                for c in choices
            ],
            "usage": response.usage(choices),
        }

    async def _events(
        choices: list[Choice], queue: asyncio.Queue[tuple[int, RequestDelta]]
    ) -> AsyncIterator[tuple[Choice, RequestDelta, str]]:
        """(choice, delta, its new text) until every choice finishes; a failed request raises. On
        the way out (done, failed, or the client gone) unfinished requests are aborted."""
        try:
            remaining = len(choices)
            while remaining:
                index, delta = await queue.get()
                choice = choices[index]
                _raise_error(delta)
                now = time.perf_counter()
                if delta.token_ids:
                    if choice.last_token_time is None:
                        metrics_state.time_to_first_token.observe(now - choice.submitted)
                    else:
                        for _ in delta.token_ids:  # a verify step's tokens arrive together
                            metrics_state.inter_token_latency.observe((now - choice.last_token_time)
                                                                      / len(delta.token_ids))
                    choice.last_token_time = now
                choice.token_ids += delta.token_ids
                choice.logprobs += delta.logprobs or []
                choice.prompt_logprobs = delta.prompt_logprobs or choice.prompt_logprobs
                piece = choice.text.add(delta) if choice.text is not None else ""
                if delta.finished:
                    choice.finish_reason = delta.finish_reason or "abort"
                    metrics_state.generation_tokens += len(choice.token_ids)
                    remaining -= 1
                yield choice, delta, piece
        finally:  # also when this generator is closed early (a disconnect cancels the handler)
            for choice in choices:
                if not choice.stream.done:
                    async_engine.abort(choice.stream)

    async def _stream(
        choices: list[Choice], queue: asyncio.Queue[tuple[int, RequestDelta]], response: Response
    ) -> AsyncIterator[str]:
        chat, gen = response.chat, response.gen

        def event(body: dict[str, object]) -> str:
            return f"data: {json.dumps({**response.header(chunk=True), **body})}\n\n"

        def chunk(choice: Choice, piece: str | None, delta: RequestDelta | None, role: bool = False) -> str:
            body: dict[str, object] = {"index": choice.index}
            if chat:
                opened = {"role": "assistant", "content": ""}
                body["delta"] = opened if role else ({"content": piece} if piece else {})
            else:
                body["text"] = piece or ""
            if delta is not None:
                body["logprobs"] = _logprobs(choice, delta.token_ids, delta.logprobs, gen, chat)
                body.update(_prompt_logprobs(delta.prompt_logprobs))
            body["finish_reason"] = delta.finish_reason if delta is not None else None
            return event({"choices": [body]})

        events = _events(choices, queue)
        try:
            if chat:
                for choice in choices:
                    yield chunk(choice, None, None, role=True)
            async for choice, delta, piece in events:
                if (piece or delta.finished or delta.prompt_logprobs is not None
                        or (delta.token_ids and gen.params.logprobs is not None)):
                    yield chunk(choice, piece, delta)
            if gen.include_usage:
                yield event({"choices": [], "usage": response.usage(choices)})
            yield "data: [DONE]\n\n"
        except RequestError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        finally:
            await events.aclose()

    def _prompt_logprobs(entries: list[dict[int, float] | None] | None) -> dict[str, object]:
        """vLLM's `prompt_logprobs` field (none when not asked): per prompt token, None for the
        first, then {token id: {logprob, decoded_token}} for the top k and the token itself."""
        if entries is None:
            return {}
        return {"prompt_logprobs": [
            None if entry is None else {str(t): {"logprob": v, "decoded_token": _token_text(t)}
                                        for t, v in entry.items()}
            for entry in entries]}

    def _token_text(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"

    def _logprobs(choice: Choice, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                  gen: GenerationRequest, chat: bool) -> dict[str, object] | None:
        """OpenAI's logprobs object for these tokens of a choice (chat: `content` entries with the
        top k; completions: parallel lists, each top dict holding the top k and the token)."""
        k = gen.params.logprobs
        if k is None or logprobs is None:
            return None
        texts = [_token_text(t) for t in token_ids]
        if chat:
            def entry(text: str, value: float) -> dict[str, object]:
                return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

            return {"content": [
                {**entry(text, top[token]),
                 "top_logprobs": [entry(_token_text(t), v) for t, v in list(top.items())[:k]]}
                for token, text, top in zip(token_ids, texts, logprobs, strict=True)]}
        offsets = []
        for text in texts:
            offsets.append(choice.text_offset)
            choice.text_offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [top[token] for token, top in zip(token_ids, logprobs, strict=True)],
            "top_logprobs": [{_token_text(t): v for t, v in top.items()} for top in logprobs],
            "text_offset": offsets,
        }

    def _raise_error(delta: RequestDelta) -> None:
        if delta.error is not None:
            raise RequestError(f"generation failed: {delta.error}", status=500)

    return app


@dataclass(frozen=True)
class Response:
    """What every body or chunk of one response shares."""

    id: str
    created: int
    model: str
    chat: bool
    prompt_tokens: int
    gen: GenerationRequest

    def header(self, chunk: bool = False) -> dict[str, object]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self, choices: list[Choice]) -> dict[str, int]:
        return _usage(self.prompt_tokens, sum(len(c.token_ids) for c in choices))


def _text(choice: Choice) -> str:
    """A model without a tokenizer gives token ids and empty text (stop strings need one: refused)."""
    return choice.text.text if choice.text is not None else ""


async def _json(request: Request) -> dict[str, object]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }

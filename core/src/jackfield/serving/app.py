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
class Counters:
    """Token counters /metrics reports (requests by finish reason come from the engine loop)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0


def create_app(async_engine: AsyncEngine, model_name: str) -> FastAPI:
    engine = async_engine.engine
    tokenizer = engine.tokenizer
    counters = Counters()
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
            f"jackfield_prompt_tokens_total {counters.prompt_tokens}",
            "# TYPE jackfield_generation_tokens_total counter",
            f"jackfield_generation_tokens_total {counters.generation_tokens}",
            "# TYPE jackfield_requests_running gauge",
            f"jackfield_requests_running {len(engine.scheduler.running)}",
            "# TYPE jackfield_requests_waiting gauge",
            f"jackfield_requests_waiting {len(engine.scheduler.waiting)}",
            "# TYPE jackfield_kv_blocks_free gauge",
            f"jackfield_kv_blocks_free {blocks.num_free}",
            "# TYPE jackfield_kv_blocks_total gauge",
            f"jackfield_kv_blocks_total {blocks.num_usable}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.post("/v1/completions")
    async def completions(request: Request) -> object:
        body = await _json(request)
        _check_model(body)
        prompts = _prompt_ids(body.get("prompt"))
        room = engine.max_model_len - max(len(p) for p in prompts)
        gen = parse_generation(body, default_max_tokens=16, max_room=room, chat=False)
        if gen.stream and len(prompts) > 1:
            raise RequestError("stream with several prompts is not supported yet", "prompt")
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
        loop = asyncio.get_running_loop()
        queues: list[asyncio.Queue[RequestDelta]] = [asyncio.Queue() for _ in prompts]
        streams: list[RequestStream] = []
        try:
            for ids, queue in zip(prompts, queues, strict=True):
                streams.append(
                    async_engine.submit(
                        ids, gen.params, lambda d, q=queue: loop.call_soon_threadsafe(q.put_nowait, d)
                    )
                )
        except ValueError as exc:
            for stream in streams:
                async_engine.abort(stream)
            raise RequestError(str(exc), field_named(str(exc)) or "prompt") from None
        counters.prompt_tokens += sum(map(len, prompts))
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if gen.stream:
            return StreamingResponse(
                _stream(streams[0], queues[0], gen, chat, request_id, created), media_type="text/event-stream"
            )
        try:
            results = await asyncio.gather(
                *(_collect(s, q, gen) for s, q in zip(streams, queues, strict=True))
            )
        finally:
            for stream in streams:
                if not stream.done:  # the client went away (the handler was cancelled)
                    async_engine.abort(stream)
        choices = []
        for index, (text, reason, token_ids) in enumerate(results):
            choices.append(
                {
                    "index": index,
                    "finish_reason": reason,
                    "logprobs": None,
                    "token_ids": token_ids,
                    **({"message": {"role": "assistant", "content": text}} if chat else {"text": text}),
                }
            )
        completion_tokens = sum(len(ids) for _, _, ids in results)
        return {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model_name,
            "choices": choices,
            "usage": _usage(sum(map(len, prompts)), completion_tokens),
        }

    async def _collect(
        stream: RequestStream, queue: asyncio.Queue[RequestDelta], gen: GenerationRequest
    ) -> tuple[str, str, list[int]]:
        """(text, finish reason, token ids) of one completion; a model without a tokenizer gives
        token ids and empty text (stop strings need one: refused)."""
        text = TextState(tokenizer, gen.params.stop) if tokenizer is not None else None
        token_ids: list[int] = []
        while True:
            delta = await queue.get()
            _raise_error(delta)
            token_ids += delta.token_ids
            if text is not None:
                text.add(delta)
            if delta.finished:
                reason = _finished(delta.finish_reason or "abort", len(token_ids))
                return (text.text if text else ""), reason, token_ids

    async def _stream(
        stream: RequestStream,
        queue: asyncio.Queue[RequestDelta],
        gen: GenerationRequest,
        chat: bool,
        request_id: str,
        created: int,
    ) -> AsyncIterator[str]:
        text = TextState(_tokenizer(), gen.params.stop)
        count = 0
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: str | None, reason: str | None, role: bool = False) -> str:
            if chat:
                delta = (
                    {"role": "assistant", "content": ""}
                    if role
                    else ({} if piece is None else {"content": piece})
                )
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": reason}
            payload = {
                "id": request_id,
                "object": kind,
                "created": created,
                "model": model_name,
                "choices": [choice],
            }
            return f"data: {json.dumps(payload)}\n\n"

        try:
            if chat:
                yield chunk(None, None, role=True)
            while True:
                delta = await queue.get()
                if delta.error is not None:
                    yield f"data: {json.dumps(RequestError(delta.error, status=500).body())}\n\n"
                    break
                count += len(delta.token_ids)
                piece = text.add(delta)
                if piece or delta.finish_reason:
                    yield chunk(piece, delta.finish_reason)
                if delta.finished:
                    _finished(delta.finish_reason or "abort", count)
                    break
            if gen.include_usage:
                payload = {
                    "id": request_id,
                    "object": kind,
                    "created": created,
                    "model": model_name,
                    "choices": [],
                    "usage": _usage(len(stream.prompt_token_ids), count),
                }
                yield f"data: {json.dumps(payload)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # a disconnect cancels this generator: the request's blocks are freed
            if not stream.done:
                async_engine.abort(stream)

    def _raise_error(delta: RequestDelta) -> None:
        if delta.error is not None:
            raise RequestError(f"generation failed: {delta.error}", status=500)

    def _finished(reason: str, num_tokens: int) -> str:
        """Count a finished completion's tokens for /metrics; returns its finish reason."""
        counters.generation_tokens += num_tokens
        return reason

    return app


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

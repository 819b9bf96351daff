"""One engine loop for many callers: requests from any thread or coroutine, batched together.

`AsyncEngine` owns an `Engine` and a thread that steps it while there is work (or a `StepDriver`
around it: `jackfield serve --pd` steps a prefill/decode pair, commands/pd.PDLLM, whose decode
engine is that `Engine`). `submit` checks a
request on the caller's thread (a bad one raises there and never reaches the loop), queues it and
returns a `RequestStream`; the loop admits queued requests between steps, so requests arriving
from different callers share steps (continuous batching). After each step every active request's
new tokens go to its stream as one `RequestDelta` through the callback the caller gave (an
asyncio caller passes `loop.call_soon_threadsafe`-style delivery). `abort` (a client that went
away) frees the request's blocks at the next step boundary. A step that raises fails the
requests it ran (each stream gets the error) and the loop goes on serving the rest.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from jackfield.contracts.sampler import SamplingParams
from jackfield.engine.engine import Engine
from jackfield.engine.sequence import Sequence, SpeculativeStats, Status


@dataclass(frozen=True)
class RequestDelta:
    """What one step added to a request: its new tokens (and their logprobs when asked), and
    whether it finished (`finish_reason`) or failed (`error`)."""

    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    error: str | None = None
    text_end: int | None = None  # where a stop string begins in the output text (Sequence.text_end)
    # SamplingParams.prompt_logprobs: the prompt's (Sequence.prompt_logprobs), on the first delta only
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(eq=False)
class RequestStream:
    """A submitted request: where its deltas go, and how far it has been delivered."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    deliver: Callable[[RequestDelta], None]
    seq: Sequence | None = None  # set once the loop admits it
    sent: int = 0  # output tokens delivered so far
    done: bool = field(default=False)


class StepDriver(Protocol):
    """What the loop steps: `Engine` itself, or something that runs requests through it."""

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None: ...
    def add_request(self, token_ids: list[int], params: SamplingParams) -> Sequence: ...
    def abort(self, seq: Sequence) -> None: ...
    def has_work(self) -> bool: ...
    def step(self) -> list[Sequence]: ...


class AsyncEngine:
    def __init__(self, engine: Engine, driver: StepDriver | None = None) -> None:
        """`engine` answers what the server reads (tokenizer, limits, KV use); `driver` (default:
        `engine`) takes the requests and steps."""
        self.engine = engine
        self.driver: StepDriver = driver if driver is not None else engine
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards the three queues below
        self._queued: list[RequestStream] = []
        self._aborted: set[int] = set()
        self._active: dict[int, RequestStream] = {}  # the loop thread's own
        self.finish_reasons: Counter[str] = Counter()  # finished requests by reason ("error": failed)
        self.speculative = SpeculativeStats()  # drafts and acceptance over finished requests
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="jackfield-engine", daemon=True)
        self._thread.start()

    def submit(
        self, prompt_token_ids: list[int], params: SamplingParams, deliver: Callable[[RequestDelta], None]
    ) -> RequestStream:
        """Check and queue a request (ValueError names what is wrong); deltas go to `deliver`,
        called on the engine thread (it must not block)."""
        self.driver.check_request(prompt_token_ids, params)
        stream = RequestStream(next(self._ids), list(prompt_token_ids), params, deliver)
        with self._lock:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            self._queued.append(stream)
        self._wake.set()
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Finish the request at the next step boundary and free its blocks (no-op once finished)."""
        with self._lock:
            self._aborted.add(stream.request_id)
        self._wake.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop: queued and running requests finish as aborted."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def num_active(self) -> int:
        return len(self._active)

    # ---- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        driver = self.driver
        while True:
            with self._lock:
                queued, self._queued = self._queued, []
                aborted, self._aborted = self._aborted, set()
                stopping = self._stopping
            for stream in queued:
                self._admit(stream)
            for stream in list(self._active.values()):
                if stopping or stream.request_id in aborted:
                    assert stream.seq is not None
                    driver.abort(stream.seq)
                    self._finish(stream, RequestDelta([], finish_reason="abort"))
            if stopping:
                return
            if not driver.has_work():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                driver.step()
            except Exception as exc:  # the requests of this step fail; the loop serves the rest
                message = f"{type(exc).__name__}: {exc}"
                for stream in list(self._active.values()):
                    assert stream.seq is not None
                    if stream.seq.status == Status.RUNNING:
                        driver.abort(stream.seq)
                        self._finish(stream, RequestDelta([], error=message))
                continue
            for stream in list(self._active.values()):
                self._send_new_tokens(stream)

    def _admit(self, stream: RequestStream) -> None:
        try:
            stream.seq = self.driver.add_request(stream.prompt_token_ids, stream.params)
        except ValueError as exc:  # the pool changed since submit checked it
            self._finish(stream, RequestDelta([], error=str(exc)))
            return
        self._active[stream.request_id] = stream

    def _send_new_tokens(self, stream: RequestStream) -> None:
        seq = stream.seq
        assert seq is not None
        new = seq.output_ids[stream.sent :]
        if not new and seq.status != Status.FINISHED:
            return
        logprobs = seq.logprobs[stream.sent :] if seq.params.logprobs is not None else None
        prompt_logprobs = seq.prompt_logprobs if stream.sent == 0 else None
        stream.sent += len(new)
        finished = seq.status == Status.FINISHED
        delta = RequestDelta(new, logprobs, seq.finish_reason if finished else None,
                             text_end=seq.text_end if finished else None, prompt_logprobs=prompt_logprobs)
        if delta.finished:
            self._finish(stream, delta)
        else:
            stream.deliver(delta)

    def _finish(self, stream: RequestStream, delta: RequestDelta) -> None:
        self.finish_reasons[delta.finish_reason or "error"] += 1
        if stream.seq is not None:
            self.speculative.add(stream.seq.speculative)
        self._active.pop(stream.request_id, None)
        stream.done = True
        stream.deliver(delta)

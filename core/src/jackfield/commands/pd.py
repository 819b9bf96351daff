"""Prefill/decode disaggregation on one host (`jackfield run --pd`): `PDLLM` is an `LLM` whose
engine here decodes, while a second engine in a child process prefills.

Each request goes to the prefill engine with max_tokens 1. It computes the prompt, samples the
first token and, through the `pd` KV connector (plugins/kv_offload), sends the prompt's KV blocks
to this process while its forward runs. The child then hands the first token (its logprobs and
timing) over a pipe; unless that token ended the request, the request continues here as prompt
+ first token with the KV connector loading the blocks, and decodes to the end: the same tokens as
one engine, since every draw is a pure function of (seed, position).

Every wait is bounded: the pipe is polled and the child's liveness checked; a child that dies or
fails leaves its requests to be computed here, whole (a warning says so); the connector's own
waits end at `timeout_s`, after which the decode engine recomputes what did not arrive.
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing
import random
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from jackfield.config import ConfigError, JackfieldConfig, resolve_config
from jackfield.contracts.sampler import SamplingParams
from jackfield.engine.llm import LLM
from jackfield.engine.sequence import Sequence, Status

STOP_WAIT_S = 10.0  # for the child to exit after it was asked to, or to say why it failed


@dataclass(frozen=True)
class Prefill:
    """A request for the prefill engine (`params.max_tokens` is the request's own)."""

    request_id: int
    token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Handoff:
    """A prefill's outcome: the first token and what the request's output needs from it."""

    request_id: int
    token: int
    logprobs: dict[int, float] | None
    finish_reason: str  # the prefill engine's: "stop" ends the request, "length" may not
    text_end: int | None
    first_token_time: float  # time.perf_counter(): CLOCK_MONOTONIC, one clock for the host's processes
    prompt_logprobs: list[dict[int, float] | None] | None
    num_cached_prefix: int


def pd_config(config: JackfieldConfig | str | Path | None, model: str | Path | None,
              overrides: Mapping[str, object], role: str, address: str) -> JackfieldConfig:
    """The config of one role: the given one with [kv_connector] set to pd (its other options kept)."""
    dotted = dict(overrides)
    if "kv_connector.options" in dotted:  # options given for --pd
        dotted.setdefault("kv_connector.name", "pd")
    base = resolve_config(config, model, dotted)
    connector = base.kv_connector
    if connector.name not in (None, "pd"):
        raise ConfigError([f"kv_connector.name: --pd runs the pd connector, the config names "
                           f"{connector.name!r}"])
    given = sorted(set(connector.options) & {"role", "address"})
    if given:
        raise ConfigError([f"kv_connector.options.{key}: set by --pd, not by the config" for key in given])
    options = {**connector.options, "role": role, "address": address}
    return resolve_config(base, None, {"kv_connector.name": "pd", "kv_connector.options": options})


def free_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


class PDLLM(LLM):
    """PDLLM(model=None, config=None, **overrides): `LLM`'s arguments; both engines get the same
    config but for [kv_connector] (pd, with a role each) and `prefill_overrides`, which the prefill
    engine alone takes (e.g. {"engine.device": "cuda:1"}: a GPU of its own). `close()` stops it;
    a script that builds one needs the `if __name__ == "__main__":` guard (the child is spawned)."""

    def __init__(self, model: str | Path | None = None, config: JackfieldConfig | str | Path | None = None,
                 *, progress: Callable[[str], None] | None = None,
                 prefill_overrides: Mapping[str, object] | None = None, **overrides: object) -> None:
        address = free_address()
        producer = pd_config(config, model, {**overrides, **(prefill_overrides or {})}, "producer", address)
        consumer = pd_config(config, model, overrides, "consumer", address)
        context = multiprocessing.get_context("spawn")
        self._pipe, child_end = context.Pipe()
        self._child = context.Process(target=run_prefill_engine, args=(producer, child_end),
                                      name="jackfield-prefill", daemon=True)
        self._child.start()
        child_end.close()
        self.producer_error: str | None = None  # why the prefill engine stopped serving, if it did
        self._next_id = 0  # request ids of this engine pair (the decode engine's own are not used)
        self._at_producer: dict[int, Sequence] = {}  # sent to the prefill engine, not handed back yet
        try:  # the connector's rendezvous waits here for the child to load its model and join
            super().__init__(config=consumer, progress=progress)
        except BaseException as exc:
            failed = self._pipe.poll(STOP_WAIT_S) and self._pipe.recv()  # (bounded: it may be slow)
            self.close()
            if isinstance(failed, str):  # the child's own error explains the rendezvous that failed
                raise ConfigError([f"the prefill engine failed to start: {failed}"]) from exc
            raise
        # Registered after the connector's own handlers, so it runs before them: the prefill
        # engine stops in order at exit (its connector says goodbye) and nothing waits on it.
        atexit.register(self.close)
        self._seeds = random.Random(self.config.sampler.seed)

    def close(self) -> None:
        atexit.unregister(self.close)
        if self._child.is_alive():
            try:
                self._pipe.send(None)
            except OSError:
                pass
            self._child.join(STOP_WAIT_S)
            if self._child.is_alive():
                self._child.terminate()
                self._child.join(STOP_WAIT_S)
        self._pipe.close()

    def __enter__(self) -> PDLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def producer_stats(self, timeout_s: float = 10.0) -> dict[str, object] | None:
        """The prefill engine's KV-connector counters (None: it is gone or did not answer)."""
        with self._lock:
            if not self._send("stats"):
                return None
            deadline = time.monotonic() + timeout_s
            try:
                while time.monotonic() < deadline:
                    if self._pipe.poll(0.05) and isinstance(message := self._pipe.recv(), dict):
                        return message  # (a handoff of an aborted call may come first: dropped)
            except (EOFError, OSError):
                self._lost("its pipe closed")
        return None

    def _send(self, message: object) -> bool:
        if self.producer_error is not None:
            return False
        try:
            self._pipe.send(message)
            return True
        except OSError as exc:
            self._lost(f"the pipe to it broke ({exc})")
            return False

    def _lost(self, reason: str) -> None:
        if self.producer_error is None:
            self.producer_error = reason
            print(f"jackfield: the prefill engine stopped: {reason}; its requests are computed by the "
                  "decode engine", file=sys.stderr)

    def add_requests(self, requests: list[tuple[list[int], SamplingParams]]) -> list[Sequence]:
        """Queue requests all or none (each checked first), each sent to the prefill engine; `step`
        moves them on. While the prefill engine is lost, they are computed here whole."""
        for token_ids, params in requests:
            self.engine.check_request(token_ids, params)
        seqs = []
        for token_ids, params in requests:
            # The seed one engine would draw (its generator, in submission order); both engines
            # then know the request by this id (the pd connector keys its blocks with it).
            seed = params.seed if params.seed is not None else self._seeds.randrange(2**63)
            params = dataclasses.replace(params, seed=seed)
            seq = Sequence(self._next_id, len(token_ids), list(token_ids), params, seed)
            self._next_id += 1
            seqs.append(seq)
            self._at_producer[seq.request_id] = seq
            self._send(Prefill(seq.request_id, seq.token_ids, params))
        return seqs

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        self.engine.check_request(token_ids, params)

    def add_request(self, token_ids: list[int], params: SamplingParams) -> Sequence:
        return self.add_requests([(token_ids, params)])[0]

    def abort(self, seq: Sequence) -> None:
        """Finish `seq` as aborted. One still at the prefill engine is finished there as it was
        asked (one prefill step; its handoff is dropped, and the KV it sent is evicted unclaimed
        after `timeout_s`); one already here is aborted by the decode engine."""
        if self._at_producer.pop(seq.request_id, None) is not None:
            seq.status, seq.finish_reason, seq.finish_time = Status.FINISHED, "abort", time.perf_counter()
        else:
            self.engine.abort(seq)

    def has_work(self) -> bool:
        return bool(self._at_producer) or self.engine.scheduler.has_work()

    def step(self) -> list[Sequence]:
        """The prefill engine's handoffs (waiting up to 50 ms for one when nothing runs here), then
        one decode step. Returns the requests that finished."""
        scheduler = self.engine.scheduler
        finished = self._take_handoffs(wait=not scheduler.has_work())  # their first token ended them
        if self._at_producer and self.producer_error is not None:
            for seq in self._at_producer.values():
                self._run_here(seq)
            self._at_producer.clear()
        if scheduler.has_work():
            finished += self.engine.step()
            if scheduler.loading and not scheduler.running:
                time.sleep(0.001)  # only waiting for KV in flight: leave the cores to it
        return finished

    def _run(self, requests: list[tuple[list[int], SamplingParams]], pooling: str | None, use_tqdm: bool,
             progress: Callable[[int, int], None] | None) -> list[Sequence]:
        """`LLM._run` across the two engines: prefill there, decode here (pooling runs here)."""
        if pooling is not None or self.producer_error is not None:
            return super()._run(requests, pooling, use_tqdm, progress)
        with self._lock:
            seqs = self.add_requests(requests)
            done = 0
            try:
                while self.has_work():
                    done += len(self.step())
                    if progress:
                        progress(done, len(seqs))
            except BaseException:
                for seq in seqs:
                    if self._at_producer.pop(seq.request_id, None) is None:  # it reached this engine
                        self.engine.scheduler.abort(seq)
                raise
        return seqs

    def _take_handoffs(self, wait: bool) -> list[Sequence]:
        """Apply the prefill engine's handoffs; returns the requests they finished."""
        finished: list[Sequence] = []
        timeout = 0.05 if wait else 0.0
        try:
            while self._pipe.poll(timeout):
                timeout = 0.0
                message = self._pipe.recv()
                if isinstance(message, str):  # the child's error, its last message
                    self._lost(message)
                elif isinstance(message, Handoff) and message.request_id in self._at_producer:
                    seq = self._at_producer.pop(message.request_id)
                    if self._continue(seq, message):
                        self.engine.scheduler.add(seq)
                    else:
                        finished.append(seq)
        except (EOFError, OSError):  # a closed pipe: the exit check below names why it went
            pass
        # Checked with no request there too: its KV sender may die after the last handoff came,
        # and a run's summary must still say the prefill engine stopped.
        if not self._child.is_alive():
            self._lost(f"its process exited with code {self._child.exitcode}")
        return finished

    def _continue(self, seq: Sequence, handoff: Handoff) -> bool:
        """Give `seq` its first token; True when it continues here, False when that finished it."""
        seq.token_ids.append(handoff.token)
        if handoff.logprobs is not None:
            seq.logprobs.append(handoff.logprobs)
        seq.first_token_time = handoff.first_token_time
        seq.prompt_logprobs = handoff.prompt_logprobs
        seq.num_cached_prefix = handoff.num_cached_prefix
        seq.text_end = handoff.text_end
        if (handoff.finish_reason == "stop" or seq.params.max_tokens == 1
                or seq.num_tokens >= self.engine.max_model_len):
            seq.status, seq.finish_reason = Status.FINISHED, handoff.finish_reason
            seq.finish_time = time.perf_counter()
            return False
        seq.params = dataclasses.replace(seq.params, prompt_logprobs=None)  # they came with the handoff
        return True

    def _run_here(self, seq: Sequence) -> None:
        """A request the prefill engine never handed back, computed here whole."""
        self.engine.scheduler.add(seq)


def run_prefill_engine(config: JackfieldConfig, pipe: Connection) -> None:
    """The child: a prefill engine serving `Prefill`s until it gets None (or the pipe closes).
    Between steps it takes new requests and sends a `Handoff` per finished one; a "stats" message
    is answered with its connector's counters. Any error is sent as text before it exits."""
    try:
        # A GPU of its own becomes the current one: kernels launch there (without CUDA the engine
        # itself says why it cannot run).
        if config.engine.device.startswith("cuda:") and torch.cuda.is_available():
            torch.cuda.set_device(torch.device(config.engine.device))
        engine = LLM(config=config).engine
        while True:
            while pipe.poll(0 if engine.scheduler.has_work() else 0.05):
                message = pipe.recv()
                if message is None:
                    return
                if message == "stats":
                    pipe.send(engine.kv_connector_stats() or {})
                elif isinstance(message, Prefill):  # the parent's id and seed (it checked the request)
                    params = dataclasses.replace(message.params, max_tokens=1)
                    seq = Sequence(message.request_id, len(message.token_ids), message.token_ids, params,
                                   message.params.seed)
                    if params.prompt_logprobs is not None:
                        seq.prompt_logprobs = [None] * len(message.token_ids)
                    engine.scheduler.add(seq)
            if not engine.scheduler.has_work():
                continue
            for seq in engine.step():
                assert seq.first_token_time is not None and seq.finish_reason is not None
                pipe.send(Handoff(seq.request_id, seq.output_ids[0],
                                  seq.logprobs[0] if seq.logprobs else None, seq.finish_reason, seq.text_end,
                                  seq.first_token_time, seq.prompt_logprobs, seq.num_cached_prefix))
    except (EOFError, OSError, KeyboardInterrupt):
        return  # the parent is gone
    except BaseException as exc:  # noqa: BLE001 (any failure is reported, then the child ends)
        try:
            pipe.send(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        except OSError:
            pass

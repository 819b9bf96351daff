"""pd's consumer (decode) roles: the CPU tier's loads over the landing zone (landing.py), plus
the wait for blocks the producer is still sending. A request's first admission expects the
producer's blocks for its prompt (every request the consumer gets was prefilled there) unless
the stream has ended or a block it needs was lost: it waits in the engine's LOADING state,
holding its blocks, until they have all arrived (then they load like a CPU-tier hit), or fails
at `timeout_s`, and the engine recomputes them. Later admissions (after a preemption) load only
what the landing zone still holds."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jackfield.contracts.kv_connector import (
    ConnectorMetadata,
    ConnectorRequest,
    ScheduledRequest,
    TransferResult,
)

from jackfield_kv_offload.connector import CpuOffloadScheduler, CpuOffloadWorker
from jackfield_kv_offload.keys import ChunkKey, GroupChunking
from jackfield_kv_offload.landing import Landing
from jackfield_kv_offload.options import OffloadOptions


@dataclass(frozen=True)
class WaitingLoad:
    """A consumer request admitted before all of its producer blocks arrived."""

    request: ConnectorRequest
    block_ids: tuple[tuple[int, ...], ...]
    num_computed: int
    num_external: int
    deadline: float  # time.monotonic()


class PDConsumerScheduler(CpuOffloadScheduler):
    """The CPU tier's scheduler side over the landing zone (loads only), plus the wait for blocks
    the producer is still sending."""

    def __init__(self, landing: Landing, chunkings: list[GroupChunking], block_size: int,
                 timeout_s: float) -> None:
        # asynchronous loads: a request may wait for blocks still on their way from the producer
        options = OffloadOptions(cpu_bytes=landing.pool.nbytes, blocks_per_chunk=1, load_mode="async")
        super().__init__(options, chunkings, landing.manager, block_size)
        self.landing, self.timeout_s = landing, timeout_s
        self.seen: set[str] = set()  # admitted before: only its first admission expects the producer
        self.waiting: dict[str, WaitingLoad] = {}
        self.counts.update(waited_loads=0, timed_out_loads=0)

    def _keys(self, request: ConnectorRequest, num_tokens: int) -> list[list[ChunkKey]]:
        """The CPU tier's keys, scoped to the request: a landed block serves only the request that
        sent it (a drafter's KV at its last position saw that request's next token, which its hash
        does not cover). Both engines give a request the same (integer) id."""
        owner = int(request.request_id)
        return [[dataclasses.replace(key, request=owner) for key in group]
                for group in super()._keys(request, num_tokens)]

    def _needed_keys(self, request: ConnectorRequest, resume_tokens: int,
                     num_computed: int) -> list[ChunkKey]:
        keys = self._keys(request, resume_tokens)
        needed = self._needed(keys, resume_tokens // self.chunkings[0].aligned_tokens, num_computed)
        return [keys[group][c] for group, chunks in enumerate(needed) for c in chunks]

    def _expected(self, request: ConnectorRequest, num_computed: int) -> int:
        """Tokens past `num_computed` whose blocks the producer sends (or sent) for this request."""
        if request.request_id in self.seen or self.landing.error is not None:
            return 0
        aligned = self.chunkings[0].aligned_tokens
        resume = (request.num_tokens - 1) // aligned * aligned
        if resume <= num_computed:
            return 0
        if any(map(self.landing.is_gone, self._needed_keys(request, resume, num_computed))):
            return 0
        return resume - num_computed

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed: int) -> tuple[int, bool]:
        with self.landing.lock:
            expected = self._expected(request, num_computed)
            return (expected, True) if expected else super().get_num_new_matched_tokens(request, num_computed)

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[Sequence[int]],
                                 num_computed: int, num_external: int) -> None:
        with self.landing.lock:
            self.seen.add(request.request_id)
            needed = self._needed_keys(request, num_computed + num_external, num_computed)
            if num_external and self.manager.lookup(needed) < len(needed):  # some are still on the way
                super().update_state_after_alloc(request, block_ids, num_computed, 0)
                self.waiting[request.request_id] = WaitingLoad(
                    request, tuple(map(tuple, block_ids)), num_computed, num_external,
                    time.monotonic() + self.timeout_s)
                self.counts["waited_loads"] += 1
            else:
                super().update_state_after_alloc(request, block_ids, num_computed, num_external)

    def _start_load(self, request: ConnectorRequest, block_ids: Sequence[Sequence[int]], num_computed: int,
                    num_external: int) -> None:
        super()._start_load(request, block_ids, num_computed, num_external)
        self.landing.claim(self.loading[request.request_id])

    def build_connector_meta(self, scheduled: Sequence[ScheduledRequest]) -> ConnectorMetadata:
        with self.landing.lock:
            self.landing.release_expired()
            failed = self._settle_waiting()
            loads, self.loads = self.loads, []
        return ConnectorMetadata({"loads": loads, "stores": [], "failed": failed})

    def _settle_waiting(self) -> list[str]:
        """Waiting loads whose blocks have all arrived start; those that cannot finish fail (the
        stream ended, a block was lost, the deadline passed). Returns the failed request ids."""
        now, failed = time.monotonic(), []
        for rid, wait in list(self.waiting.items()):
            resume = wait.num_computed + wait.num_external
            needed = self._needed_keys(wait.request, resume, wait.num_computed)
            if self.manager.lookup(needed) == len(needed):
                del self.waiting[rid]
                self._start_load(wait.request, wait.block_ids, wait.num_computed, wait.num_external)
            elif (self.landing.error is not None or now > wait.deadline
                  or any(map(self.landing.is_gone, needed))):
                del self.waiting[rid]  # the worker reports it failed: the engine recomputes its blocks
                failed.append(rid)
                self.counts["timed_out_loads"] += now > wait.deadline
        return failed

    def update_connector_output(self, result: TransferResult) -> None:
        with self.landing.lock:
            super().update_connector_output(result)

    def request_finished(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> bool:
        self.seen.discard(request_id)
        return super().request_finished(request_id, block_ids)

    def stats(self) -> dict[str, int]:
        with self.landing.lock:
            return {**super().stats(), **self.landing.counts, "waiting_loads": len(self.waiting),
                    "unclaimed_chunks": len(self.landing.held)}


class PDConsumerWorker(CpuOffloadWorker):
    """The CPU tier's loads; loads the scheduler side gave up on are reported failed."""

    def start_load_kv(self, metadata: ConnectorMetadata, kv_caches: Sequence[torch.Tensor]) -> None:
        self.failed_loads.update(metadata.payload["failed"])  # type: ignore[arg-type]
        super().start_load_kv(metadata, kv_caches)

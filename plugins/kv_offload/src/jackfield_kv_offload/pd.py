"""pd: prefill/decode disaggregation. Two engines in two processes share one model and config:
the producer (prefill) computes prompts and exports their KV, the consumer (decode) loads it and
continues (`jackfield run --pd` starts both; docs/kv_offload.md).

What moves is whole KV blocks of verified tokens, named by the chunk keys of the CPU tier
(KV cache group + the engine's chained block hash; both engines need one
`engine.prefix_hash_seed`). A request with n prompt tokens resumes on the consumer after
floor(n / block_size) blocks (a load never covers the last token): full-attention groups move
all of them, window groups only the blocks the window reaches from there (`GroupChunking`). The
consumer computes the rest, at most one block.

Producer: each step, the blocks the step completed that the consumer will read (never past
`ScheduledRequest.num_exportable`, so never draft KV) form one transfer: BEGIN with their keys
before the forward, each layer's rows right after that layer wrote them (gathered on the compute
stream, sent by the sender thread), END after the forward. Its blocks are free again at once:
the rows were copied out.

Consumer: a request's first admission expects the producer's blocks for its prompt (every request
it gets was prefilled there) unless the stream has ended or a block it needs was lost: it waits
in the engine's LOADING state, holding its blocks, until they have all arrived (then they load
like a CPU-tier hit), or fails at `timeout_s`, and the engine recomputes them. Later admissions
(after a preemption) load only what the landing zone still holds.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jackfield.contracts.kv_connector import (
    ConnectorMetadata,
    ConnectorRequest,
    KVConnectorContext,
    KVConnectorScheduler,
    KVConnectorWorker,
    ScheduledRequest,
    TransferResult,
)
from jackfield.ops.staging import async_tensor_h2d

from jackfield_kv_offload.channel import Channel, GlooChannel, Kind, Outgoing, Sender, header
from jackfield_kv_offload.connector import CpuOffloadScheduler, CpuOffloadWorker
from jackfield_kv_offload.keys import ChunkKey, GroupChunking, group_chunkings
from jackfield_kv_offload.landing import Landing, Receiver
from jackfield_kv_offload.manager import OffloadManager
from jackfield_kv_offload.options import PREFIX, OffloadOptions, parse_pd_options
from jackfield_kv_offload.policies import make_policy
from jackfield_kv_offload.transfer import CachePlanes, HostPool


@dataclass(frozen=True)
class Export:
    """One step's transfer: its chunks (one block each) grouped by KV cache group, per chunk its
    request (an index into `requests`), and each group's device blocks in chunk order."""

    keys: tuple[ChunkKey, ...]
    owners: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    requests: tuple[str, ...]


class PDProducerScheduler(KVConnectorScheduler):
    def __init__(self, chunkings: list[GroupChunking]) -> None:
        self.chunkings = chunkings
        self.next_chunk: dict[str, list[int]] = {}  # request id -> per group, the next block to consider
        self.counts = {"exported_blocks": 0, "exported_requests": 0}

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed: int) -> int:
        return 0  # the producer computes every prompt

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[Sequence[int]],
                                 num_computed: int, num_external: int) -> None:
        # Blocks sent before a preemption stay valid at the consumer: they are not sent again.
        if request.request_id not in self.next_chunk:
            self.counts["exported_requests"] += 1
            self.next_chunk[request.request_id] = [0] * len(self.chunkings)

    def build_connector_meta(self, scheduled: Sequence[ScheduledRequest]) -> ConnectorMetadata:
        keys: list[list[tuple[ChunkKey, int]]] = [[] for _ in self.chunkings]  # (key, its request)
        blocks: list[list[int]] = [[] for _ in self.chunkings]
        requests: list[str] = []
        for item in scheduled:
            request = item.request
            start = self.next_chunk.setdefault(request.request_id, [0] * len(self.chunkings))
            resume = request.num_tokens // self.chunkings[0].aligned_tokens  # in segments
            complete = item.num_exportable // self.chunkings[0].tokens_per_chunk  # whole verified blocks
            before = sum(map(len, keys))
            for group, chunking in enumerate(self.chunkings):
                reached = chunking.needed_chunks(resume)
                end = min(complete, reached.stop)
                for chunk in range(max(start[group], reached.start), end):
                    keys[group].append((ChunkKey(group, request.block_hashes[chunk]), len(requests)))
                    blocks[group].append(item.block_ids[group][chunk])
                start[group] = max(start[group], end)
            if sum(map(len, keys)) > before:
                requests.append(request.request_id)
        flat = [entry for group_keys in keys for entry in group_keys]
        self.counts["exported_blocks"] += len(flat)
        export = None
        if flat:
            export = Export(tuple(key for key, _ in flat), tuple(owner for _, owner in flat),
                            tuple(map(tuple, blocks)), tuple(requests))
        return ConnectorMetadata({"export": export})

    def update_connector_output(self, result: TransferResult) -> None:
        pass  # the producer holds nothing: its blocks' rows were copied out during the step

    def request_finished(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> bool:
        self.next_chunk.pop(request_id, None)
        return False

    def stats(self) -> dict[str, int]:
        return dict(self.counts)


class PDProducerWorker(KVConnectorWorker):
    def __init__(self, cache: CachePlanes, layer_group: tuple[int, ...], sender: Sender,
                 device: torch.device) -> None:
        self.cache, self.layer_group, self.sender, self.device = cache, layer_group, sender, device
        self.transfer = 0
        self.current: list[torch.Tensor | None] | None = None  # this step's device block ids per group
        self.in_flight: dict[int, tuple[str, ...]] = {}  # transfer -> its requests
        self.failed: set[str] = set()

    def start_load_kv(self, metadata: ConnectorMetadata, kv_caches: Sequence[torch.Tensor]) -> None:
        export: Export | None = metadata.payload["export"]  # type: ignore[assignment]
        self.current = None
        if export is None:
            return
        if self.sender.error is not None:  # the consumer is gone: nothing more is sent
            self.failed.update(export.requests)
            return
        self.transfer += 1
        self.current = [async_tensor_h2d(list(b), torch.int64, self.device, pin_memory=True) if b else None
                        for b in export.blocks]
        keys = torch.tensor([[k.group, k.block_hash, owner] for k, owner in zip(export.keys, export.owners,
                                                                                strict=True)],
                            dtype=torch.int64)
        self.sender.put(Outgoing(Kind.BEGIN, self.transfer, len(export.keys), tensors=(keys,)))
        self.in_flight[self.transfer] = export.requests

    def wait_for_layer_load(self, layer: int) -> None:
        pass  # the producer loads nothing

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor, metadata: ConnectorMetadata) -> None:
        ids = None if self.current is None else self.current[self.layer_group[layer]]
        if ids is None:
            return
        rows = self.cache.gather(layer, ids)  # on the compute stream, right after the layer wrote them
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self.sender.put(Outgoing(Kind.LAYER, self.transfer, len(ids), layer, rows, ready))

    def wait_for_save(self) -> None:
        if self.current is not None:
            self.sender.put(Outgoing(Kind.END, self.transfer))
            self.current = None

    def get_finished(self) -> TransferResult:
        ended = self.sender.take_ended()
        done = {rid for t in ended for rid in self.in_flight.pop(t, ())}
        if self.sender.error is not None:  # what was not sent in full never will be
            self.failed.update(rid for rids in self.in_flight.values() for rid in rids)
            self.in_flight.clear()
        still = {rid for rids in self.in_flight.values() for rid in rids}
        failed, self.failed = self.failed, set()
        return TransferResult(saved=frozenset(done - still - failed), failed_saves=frozenset(failed))


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
        options = OffloadOptions(cpu_bytes=landing.pool.nbytes, blocks_per_chunk=1)
        super().__init__(options, chunkings, landing.manager, block_size)
        self.landing, self.timeout_s = landing, timeout_s
        self.seen: set[str] = set()  # admitted before: only its first admission expects the producer
        self.waiting: dict[str, WaitingLoad] = {}
        self.counts.update(waited_loads=0, timed_out_loads=0)

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

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed: int) -> int:
        with self.landing.lock:
            expected = self._expected(request, num_computed)
            return expected or super().get_num_new_matched_tokens(request, num_computed)

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


def layout(context: KVConnectorContext, cache: CachePlanes) -> list[int]:
    """What both engines must agree on for blocks to mean the same thing, as integers."""
    out = [context.block_size, len(context.layers), len(context.coverage), context.lookahead_tokens]
    out += [c.sliding_window or 0 for c in context.coverage]
    for layer, group in enumerate(context.layer_group):
        planes = cache.of_layer(layer)
        out += [group, cache.layer_tensor[layer], len(planes)]
        out += [p.shape[1] * p.element_size() for p in planes]
    return out


def handshake(channel: Channel, producer: bool, mine: list[int]) -> None:
    """The producer sends its layout, the consumer says whether it is its own: ValueError if not."""
    if producer:
        channel.send(header(Kind.HELLO, count=len(mine)))
        channel.send(torch.tensor(mine, dtype=torch.int64))
        reply = torch.empty(4, dtype=torch.int64)
        channel.recv(reply)
        if reply[2] != 1:
            raise ValueError("the consumer's KV cache layout differs from this producer's (same model, "
                             "dtype, kv_cache_dtype, block_size and drafter on both sides?)")
        return
    hello = torch.empty(4, dtype=torch.int64)
    channel.recv(hello)
    theirs = torch.empty(int(hello[2]), dtype=torch.int64)
    channel.recv(theirs)
    same = theirs.tolist() == mine
    channel.send(header(Kind.ACK, count=int(same)))
    if not same:
        raise ValueError(f"the producer's KV cache layout {theirs.tolist()} differs from this "
                         f"consumer's {mine} (block size, layers, groups, lookahead, windows, then per "
                         "layer: group, tensor, planes, bytes per block row)")


def make_pd(context: KVConnectorContext) -> tuple[KVConnectorScheduler, KVConnectorWorker]:
    """The role `options.role` names, joined to the other engine at `options.address` (ValueError:
    a bad option, no peer within connect_timeout_s, or a peer with another cache layout)."""
    options = parse_pd_options(context.options)
    producer = options.role == "producer"
    chunkings = group_chunkings(context.coverage, [1] * len(context.coverage), context.lookahead_tokens)
    cache = CachePlanes(context)
    num_slots = options.cpu_bytes // HostPool.chunk_bytes(context, 1)
    if not producer and num_slots < 1:
        raise ValueError(f"{PREFIX}.cpu_bytes ({options.cpu_bytes}) is smaller than one KV block "
                         f"({HostPool.chunk_bytes(context, 1)} bytes in every KV cache tensor)")
    try:
        channel = GlooChannel(options.address, producer, options.timeout_s, options.connect_timeout_s)
        handshake(channel, producer, layout(context, cache))
    except (ConnectionError, RuntimeError) as exc:
        raise ValueError(str(exc)) from None
    if producer:
        sender = Sender(channel, heartbeat_s=options.timeout_s / 4)
        atexit.register(sender.close)
        worker = PDProducerWorker(cache, context.layer_group, sender, context.device)
        return PDProducerScheduler(chunkings), worker
    manager = OffloadManager(num_slots, make_policy("lru", num_slots))
    pool = HostPool(context, 1, num_slots)
    landing = Landing(manager, pool, context.layer_group, len(context.coverage), hold_s=options.timeout_s)
    layouts = [[(p.shape[1], p.dtype) for p in cache.of_layer(layer)] for layer in range(len(context.layers))]
    receiver = Receiver(channel, landing, layouts)
    # Registered after the launcher's own exit handler, so it runs first: it stops the producer.
    atexit.register(receiver.join, options.timeout_s)
    return (PDConsumerScheduler(landing, chunkings, context.block_size, options.timeout_s),
            PDConsumerWorker(pool, context.layer_group))


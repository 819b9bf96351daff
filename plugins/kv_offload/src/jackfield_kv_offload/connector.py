"""cpu_offload: the KV-connector roles over a CPU tier.

Scheduler side: on admission, the longest run of chunks past the device prefix hit that the tier
holds (full groups every chunk, window groups only the chunks the window needs) is offered; once
the request has blocks, those chunks are referenced and a load job goes into the next step's
metadata. Each step, chunks a scheduled request has completed (verified tokens only) that a
future request can reach are stored, all-or-nothing per request and step. The worker's reports
complete loads (references dropped) and stores (chunks made ready, or freed when a copy failed).

Worker side: loads are queued layer by layer on the load stream before the forward. With
`load_mode = "layerwise"` (the default) they are in-step: the request computes its new tokens in
the same step, and each layer's attention waits for that layer's copies only (the compute stream
waits on the layer's event; a CPU-only engine copied everything before the forward), so a
layer's compute overlaps the later layers' copies. With "async" the request waits for a step
whose start finds the load finished, and nothing else waits on the copy. Stores are queued layer
by layer as each layer writes its KV. A copy that raises fails its request's transfer: a failed
load's blocks are recomputed by the engine (a failed in-step load also fails the request's stores
of that step, computed over the blocks it could not load), a failed store's chunks are freed,
never read.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
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

from jackfield_kv_offload.keys import ChunkKey, GroupChunking, chunk_keys, group_chunkings
from jackfield_kv_offload.manager import OffloadManager
from jackfield_kv_offload.options import PREFIX, OffloadOptions, parse_options
from jackfield_kv_offload.policies import make_policy
from jackfield_kv_offload.transfer import HostPool, Pairs


@dataclass(frozen=True)
class TransferJob:
    """One request's copies in one step: per KV cache group, (host row, device block) pairs."""

    request_id: str
    pairs: tuple[tuple[tuple[int, int], ...], ...]


class CpuOffloadScheduler(KVConnectorScheduler):
    def __init__(self, options: OffloadOptions, chunkings: list[GroupChunking], manager: OffloadManager,
                 block_size: int) -> None:
        self.options, self.chunkings, self.manager = options, chunkings, manager
        self.block_size = block_size
        self.loads: list[TransferJob] = []  # for the next step's metadata
        self.loading: dict[str, list[ChunkKey]] = {}  # request id -> chunks referenced by its load
        self.storing: dict[str, list[ChunkKey]] = defaultdict(list)  # request id -> chunks in flight
        self.next_store: dict[str, list[int]] = {}  # request id -> per group, the next chunk to consider
        self.lookups: OrderedDict[ChunkKey, int] = OrderedDict()  # for store_threshold (bounded)
        self.counts = {"lookups": 0, "hit_tokens": 0, "loaded_chunks": 0, "stored_chunks": 0,
                       "evicted_chunks": 0, "stores_skipped": 0, "failed_loads": 0, "failed_saves": 0}

    def _keys(self, request: ConnectorRequest, num_tokens: int) -> list[list[ChunkKey]]:
        """Per group, the keys of the chunks that lie within the first `num_tokens` tokens."""
        out = []
        for group, chunking in enumerate(self.chunkings):
            chunks = num_tokens // chunking.tokens_per_chunk
            out.append(chunk_keys(request.block_hashes[: chunks * chunking.blocks_per_chunk], group,
                                  chunking.blocks_per_chunk))
        return out

    def _needed(self, keys: list[list[ChunkKey]], segments: int, num_computed: int) -> list[list[int]]:
        """Per group, the chunks a request resuming after `segments` segments needs and the
        device does not hold (those that end past `num_computed`)."""
        return [[c for c in ch.needed_chunks(segments) if (c + 1) * ch.tokens_per_chunk > num_computed]
                for ch in self.chunkings]

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed: int) -> tuple[int, bool]:
        load_async = self.options.load_mode == "async"
        aligned = self.chunkings[0].aligned_tokens
        usable = request.num_tokens - 1  # the last token is always computed
        keys = self._keys(request, usable)
        for segments in range(usable // aligned, num_computed // aligned, -1):  # longest hit first
            needed = self._needed(keys, segments, num_computed)
            if all(self.manager.lookup([k[c] for c in chunks]) == len(chunks)
                   for k, chunks in zip(keys, needed, strict=True)):
                return segments * aligned - num_computed, load_async
        return 0, load_async

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[Sequence[int]],
                                 num_computed: int, num_external: int) -> None:
        rid = request.request_id
        keys = self._keys(request, request.num_tokens - 1)
        self.counts["lookups"] += 1
        for group_keys in keys:
            self.manager.touch(group_keys)
            for key in group_keys:
                self.lookups[key] = self.lookups.get(key, 0) + 1
                self.lookups.move_to_end(key)
        while len(self.lookups) > 4 * self.manager.num_slots + 1024:
            self.lookups.popitem(last=False)
        self.next_store[rid] = [0] * len(self.chunkings)
        if num_external:
            self._start_load(request, block_ids, num_computed, num_external)

    def _start_load(self, request: ConnectorRequest, block_ids: Sequence[Sequence[int]], num_computed: int,
                    num_external: int) -> None:
        """Reference the chunks a request resuming at `num_computed + num_external` reads past its
        device hit (all held and ready) and queue their load for the next step's metadata."""
        keys = self._keys(request, request.num_tokens - 1)
        segments = (num_computed + num_external) // self.chunkings[0].aligned_tokens
        needed = self._needed(keys, segments, num_computed)
        referenced: list[ChunkKey] = []
        pairs = []
        first_block = num_computed // self.block_size
        for group, (chunking, chunks) in enumerate(zip(self.chunkings, needed, strict=True)):
            chunk_list = [keys[group][c] for c in chunks]
            slots = self.manager.prepare_load(chunk_list)
            referenced += chunk_list
            bpc = chunking.blocks_per_chunk
            pairs.append(tuple((slot * bpc + j, block_ids[group][c * bpc + j])
                               for c, slot in zip(chunks, slots, strict=True) for j in range(bpc)
                               if c * bpc + j >= first_block))
        self.loading[request.request_id] = referenced
        self.loads.append(TransferJob(request.request_id, tuple(pairs)))
        self.counts["hit_tokens"] += num_external
        self.counts["loaded_chunks"] += len(referenced)

    def build_connector_meta(self, scheduled: Sequence[ScheduledRequest]) -> ConnectorMetadata:
        stores = [job for job in map(self._store_job, scheduled) if job is not None]
        loads, self.loads = self.loads, []
        return ConnectorMetadata({"loads": loads, "stores": stores})

    def _store_job(self, item: ScheduledRequest) -> TransferJob | None:
        """The chunks `item` completes this step that are worth holding, if the tier makes room."""
        rid = item.request.request_id
        keys = self._keys(item.request, item.num_exportable)
        start = self.next_store.setdefault(rid, [0] * len(self.chunkings))
        wanted: list[tuple[int, int, ChunkKey]] = []  # (group, chunk, key)
        for group, chunking in enumerate(self.chunkings):
            for c in range(start[group], len(keys[group])):
                key = keys[group][c]
                threshold = self.options.store_threshold
                if chunking.reachable(c) and (threshold == 1 or self.lookups.get(key, 0) >= threshold):
                    wanted.append((group, c, key))
            start[group] = max(start[group], len(keys[group]))
        if not wanted:
            return None
        plan = self.manager.prepare_store([key for _, _, key in wanted])
        if plan is None:
            self.counts["stores_skipped"] += len(wanted)
            return None
        self.counts["evicted_chunks"] += len(plan.evicted)
        self.counts["stored_chunks"] += len(plan.keys)
        self.storing[rid] += plan.keys
        slot_of = dict(zip(plan.keys, plan.slots, strict=True))
        pairs: list[list[tuple[int, int]]] = [[] for _ in self.chunkings]
        for group, c, key in wanted:
            if key in slot_of:
                bpc = self.chunkings[group].blocks_per_chunk
                blocks = item.block_ids[group][c * bpc : (c + 1) * bpc]
                pairs[group] += [(slot_of[key] * bpc + j, block) for j, block in enumerate(blocks)]
        return TransferJob(rid, tuple(map(tuple, pairs)))

    def update_connector_output(self, result: TransferResult) -> None:
        for rid in result.loaded | result.failed_loads:
            self.manager.complete_load(self.loading.pop(rid, []))
        self.counts["failed_loads"] += len(result.failed_loads)
        for rid in result.saved | result.failed_saves:
            self.manager.complete_store(self.storing.pop(rid, []), rid not in result.failed_saves)
        self.counts["failed_saves"] += len(result.failed_saves)

    def request_finished(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> bool:
        # Stores run ahead of any later compute-stream write (the worker orders them), so the
        # blocks may be reused at once; the chunks become ready when the worker reports them.
        self.next_store.pop(request_id, None)
        return False

    def stats(self) -> dict[str, int]:
        held = sum(1 for chunk in self.manager.chunks.values() if chunk.ready)
        return {**self.counts, "cpu_chunks_held": held, "cpu_chunk_slots": self.manager.num_slots}


class CpuOffloadWorker(KVConnectorWorker):
    def __init__(self, pool: HostPool, layer_group: tuple[int, ...], layerwise: bool) -> None:
        """layerwise: the step's loads are in-step (each layer waits for its own copies)."""
        self.pool, self.layer_group, self.layerwise = pool, layer_group, layerwise
        self.layer_loaded: list[torch.cuda.Event | None] = []  # this step's in-step loads, per layer
        self.in_flight_loads: list[tuple[torch.cuda.Event | None, str]] = []
        self.in_flight_saves: list[tuple[torch.cuda.Event | None, set[str]]] = []
        self.failed_loads: set[str] = set()
        self.failed_saves: set[str] = set()
        self.step_saves: set[str] = set()

    def start_load_kv(self, metadata: ConnectorMetadata, kv_caches: Sequence[torch.Tensor]) -> None:
        jobs: list[TransferJob] = metadata.payload["loads"]  # type: ignore[assignment]
        self.layer_loaded = []
        for layer, group in enumerate(self.layer_group):  # layer by layer, as the forward goes
            for job in jobs:
                if job.request_id not in self.failed_loads:
                    self._copy(self.pool.load_layer, layer, job.pairs[group], job.request_id,
                               self.failed_loads)
            if self.layerwise and jobs:
                self.layer_loaded.append(self.pool.record(self.pool.load_stream))
        self.pool.end_step()
        event = self.pool.record(self.pool.load_stream)
        self.in_flight_loads += [(event, job.request_id) for job in jobs
                                 if job.request_id not in self.failed_loads]

    def wait_for_layer_load(self, layer: int) -> None:
        """In-step loads: the compute stream waits for this layer's copies (on a CPU-only engine
        they are done). Asynchronous loads need no wait: their request is in no step until its
        load has finished, so no layer reads a block in flight."""
        if layer < len(self.layer_loaded):
            self.pool.wait(self.layer_loaded[layer])

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor, metadata: ConnectorMetadata) -> None:
        jobs: list[TransferJob] = metadata.payload["stores"]  # type: ignore[assignment]
        group = self.layer_group[layer]
        for job in jobs:
            self.step_saves.add(job.request_id)
            if self.layerwise and job.request_id in self.failed_loads:
                self.failed_saves.add(job.request_id)  # its KV was computed over blocks never loaded
            if job.request_id not in self.failed_saves:
                self._copy(self.pool.store_layer, layer, job.pairs[group], job.request_id, self.failed_saves)

    def wait_for_save(self) -> None:
        self.pool.end_step()
        self.pool.order_compute_after_stores()
        if self.step_saves:
            self.in_flight_saves.append((self.pool.record(self.pool.store_stream), self.step_saves))
            self.step_saves = set()

    def get_finished(self) -> TransferResult:
        loaded = {rid for event, rid in self.in_flight_loads if _done(event)}
        self.in_flight_loads = [(e, rid) for e, rid in self.in_flight_loads if rid not in loaded]
        # A request's saves are reported once every save it was issued has finished.
        done = [_done(event) for event, _ in self.in_flight_saves]
        done_saves = [ids for (_, ids), d in zip(self.in_flight_saves, done, strict=True) if d]
        self.in_flight_saves = [item for item, d in zip(self.in_flight_saves, done, strict=True) if not d]
        still_saving = {rid for _, ids in self.in_flight_saves for rid in ids}
        finished_saves = {rid for ids in done_saves for rid in ids} - still_saving
        failed_saves = finished_saves & self.failed_saves
        self.failed_saves -= failed_saves
        failed_loads, self.failed_loads = self.failed_loads, set()
        return TransferResult(saved=frozenset(finished_saves - failed_saves), loaded=frozenset(loaded),
                              failed_saves=frozenset(failed_saves), failed_loads=frozenset(failed_loads))

    @staticmethod
    def _copy(copy: object, layer: int, pairs: Pairs, request_id: str, failed: set[str]) -> None:
        """One layer of one request's transfer; a copy that raises fails the request's transfer."""
        if not pairs:
            return
        try:
            copy(layer, pairs)  # type: ignore[operator]
        except (RuntimeError, ValueError, OSError):
            failed.add(request_id)


def _done(event: torch.cuda.Event | None) -> bool:
    return event is None or event.query()


def make_cpu_offload(context: KVConnectorContext) -> tuple[CpuOffloadScheduler, CpuOffloadWorker]:
    """The connector's two roles over a host pool sized by the options (ValueError naming the
    option that does not fit)."""
    options = parse_options(context.options)
    bpc = options.blocks_per_chunk
    chunkings = group_chunkings(context.coverage, [bpc] * len(context.coverage), context.lookahead_tokens)
    chunk_bytes = HostPool.chunk_bytes(context, bpc)
    num_slots = options.cpu_bytes // chunk_bytes
    if num_slots < 1:
        raise ValueError(f"{PREFIX}.cpu_bytes ({options.cpu_bytes}) is smaller than one chunk "
                         f"({chunk_bytes} bytes: {PREFIX}.blocks_per_chunk = {bpc} blocks of "
                         f"{context.block_size} tokens in every KV cache tensor)")
    manager = OffloadManager(num_slots, make_policy(options.eviction_policy, num_slots))
    pool = HostPool(context, bpc, num_slots)
    return (CpuOffloadScheduler(options, chunkings, manager, context.block_size),
            CpuOffloadWorker(pool, context.layer_group, layerwise=options.load_mode == "layerwise"))

"""pd's producer (prefill) roles: each step, the blocks the step completed that the consumer will
read (never past `ScheduledRequest.num_exportable`, so never draft KV) form one transfer: BEGIN
with their keys (and each one's request) before the forward, each layer's rows right after that
layer wrote them (gathered on the compute stream, sent by the sender thread), END after the
forward. Its blocks are free again at once: the rows were copied out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jackfield.contracts.kv_connector import (
    ConnectorMetadata,
    ConnectorRequest,
    KVConnectorScheduler,
    KVConnectorWorker,
    ScheduledRequest,
    TransferResult,
)
from jackfield.ops.staging import async_tensor_h2d

from jackfield_kv_offload.channel import Kind, Outgoing, Sender
from jackfield_kv_offload.keys import ChunkKey, GroupChunking
from jackfield_kv_offload.transfer import CachePlanes


@dataclass(frozen=True)
class Export:
    """One step's transfer: its chunks (one block each, keyed with their request) grouped by KV
    cache group, each group's device blocks in the same order, and the requests they belong to."""

    keys: tuple[ChunkKey, ...]
    blocks: tuple[tuple[int, ...], ...]
    requests: tuple[str, ...]


class PDProducerScheduler(KVConnectorScheduler):
    def __init__(self, chunkings: list[GroupChunking]) -> None:
        self.chunkings = chunkings
        self.next_chunk: dict[str, list[int]] = {}  # request id -> per group, the next block to consider
        self.counts = {"exported_blocks": 0, "exported_requests": 0}

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed: int) -> tuple[int, bool]:
        return 0, True  # the producer computes every prompt

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[Sequence[int]],
                                 num_computed: int, num_external: int) -> None:
        # Blocks sent before a preemption stay valid at the consumer: they are not sent again.
        if request.request_id not in self.next_chunk:
            self.counts["exported_requests"] += 1
            self.next_chunk[request.request_id] = [0] * len(self.chunkings)

    def build_connector_meta(self, scheduled: Sequence[ScheduledRequest]) -> ConnectorMetadata:
        keys: list[list[ChunkKey]] = [[] for _ in self.chunkings]
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
                    keys[group].append(ChunkKey(group, request.block_hashes[chunk], int(request.request_id)))
                    blocks[group].append(item.block_ids[group][chunk])
                start[group] = max(start[group], end)
            if sum(map(len, keys)) > before:
                requests.append(request.request_id)
        flat = tuple(key for group_keys in keys for key in group_keys)
        self.counts["exported_blocks"] += len(flat)
        export = Export(flat, tuple(map(tuple, blocks)), tuple(requests)) if flat else None
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
        keys = torch.tensor([[k.group, k.block_hash, k.request] for k in export.keys], dtype=torch.int64)
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

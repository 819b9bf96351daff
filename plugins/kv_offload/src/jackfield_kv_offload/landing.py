"""The consumer's landing zone: host memory where the producer's chunks arrive and wait for their
request (the CPU tier's manager and host pool, filled from the network instead of the device).

The receiver thread reads the producer's stream in order: BEGIN reserves slots for a transfer's
chunks, each request's all or none (`prepare_store`: chunks already held are skipped, unused
ready ones evicted; a request with no room has its chunks received and dropped), each LAYER's
rows are written into the reserved slots as they arrive, and END makes the chunks ready only if
every layer arrived. Anything less (a missing layer, a broken stream, a producer that stopped)
frees the reserved slots: a chunk is found only whole. Chunks lost after arriving (evicted) or
never stored are remembered as `gone`, so a request waiting for one fails at once instead of at
its deadline. Chunks that arrived are held (a load reference) until a load claims them or
`hold_s` passes: arrivals evict only chunks already read or long unclaimed.

The scheduler side reads the same manager; every use of it, on either thread, holds `lock`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from jackfield_kv_offload.channel import HEADER, Channel, Kind
from jackfield_kv_offload.keys import ChunkKey
from jackfield_kv_offload.manager import OffloadManager
from jackfield_kv_offload.transfer import HostPool


@dataclass
class Arrival:
    """A transfer being received. Per group: how many rows each of its layers sends, and where the
    kept ones go: (indices into those rows, host rows), or None when none is kept."""

    keys: list[ChunkKey]
    rows: list[int]
    kept: list[tuple[torch.Tensor, torch.Tensor] | None]
    stored: tuple[ChunkKey, ...]  # reserved by this transfer: ready at its END, freed otherwise
    layers_left: set[int] = field(default_factory=set)


class Landing:
    """`hold_s`: how long chunks that arrived are kept from eviction while no load has claimed
    them (a burst of prefills must not evict what the decode engine has not admitted yet)."""

    def __init__(self, manager: OffloadManager, pool: HostPool, layer_group: tuple[int, ...],
                 num_groups: int, hold_s: float) -> None:
        self.manager, self.pool = manager, pool
        self.layer_group, self.num_groups, self.hold_s = layer_group, num_groups, hold_s
        self.lock = threading.Lock()
        self.gone: OrderedDict[ChunkKey, None] = OrderedDict()
        self.held: OrderedDict[ChunkKey, float] = OrderedDict()  # unclaimed arrivals -> until when
        self.error: str | None = None  # why the stream ended; no transfer comes after it
        self.counts = {"received_chunks": 0, "dropped_chunks": 0, "evicted_chunks": 0, "aborted_transfers": 0}

    def claim(self, keys: list[ChunkKey]) -> None:
        """A load took its own references to `keys`: they need no holding any more (`lock` held)."""
        for key in keys:
            if self.held.pop(key, None) is not None:
                self.manager.complete_load([key])

    def release_expired(self) -> None:
        """Unclaimed arrivals past their time become evictable (`lock` held)."""
        now = time.monotonic()
        while self.held and next(iter(self.held.values())) < now:
            key, _ = self.held.popitem(last=False)
            self.manager.complete_load([key])

    def is_gone(self, key: ChunkKey) -> bool:
        """Lost after arriving or never stored, and not back since (call with `lock` held)."""
        return key in self.gone and self.manager.lookup([key]) == 0

    def begin(self, keys: list[ChunkKey]) -> Arrival:
        """Reserve slots for a transfer's chunks, all or none of each request's: one request with
        no room drops only its own."""
        rows = [sum(1 for k in keys if k.group == g) for g in range(self.num_groups)]
        slot_of: dict[ChunkKey, int] = {}
        with self.lock:
            self.release_expired()
            for request in dict.fromkeys(key.request for key in keys):
                mine = [key for key in keys if key.request == request]
                plan = self.manager.prepare_store(mine)
                if plan is None:  # every held chunk is being read: receive these and drop them
                    self.counts["dropped_chunks"] += len(mine)
                    self._mark_gone(mine)
                    continue
                self.counts["evicted_chunks"] += len(plan.evicted)
                self._mark_gone(plan.evicted)
                slot_of.update(zip(plan.keys, plan.slots, strict=True))
        stored = tuple(slot_of)
        kept: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for group in range(self.num_groups):
            index, host_rows = [], []
            for i, key in enumerate(k for k in keys if k.group == group):
                if key in slot_of:  # reserved now (one held already is not written again)
                    index.append(i)
                    host_rows.append(slot_of.pop(key))
            kept.append((torch.tensor(index), torch.tensor(host_rows)) if index else None)
        layers = {layer for layer, group in enumerate(self.layer_group) if rows[group]}
        return Arrival(keys, rows, kept, stored, layers)

    def write(self, arrival: Arrival, layer: int, data: list[torch.Tensor]) -> None:
        """One layer's rows (per plane) into the slots reserved for them."""
        kept = arrival.kept[self.layer_group[layer]]
        if kept is not None:
            index, host_rows = kept
            if len(index) < data[0].shape[0]:
                data = [d.index_select(0, index) for d in data]
            self.pool.write_rows(layer, host_rows, data)
        arrival.layers_left.discard(layer)

    def end(self, arrival: Arrival, whole: bool) -> None:
        """The transfer is over: its chunks become readable if it is `whole`, else are freed."""
        with self.lock:
            self.manager.complete_store(arrival.stored, whole)
            if whole:
                self.counts["received_chunks"] += len(arrival.stored)
                until = time.monotonic() + self.hold_s
                for key in dict.fromkeys(arrival.keys):
                    if not self.manager.lookup([key]):
                        continue  # dropped at BEGIN: it stays gone
                    self.gone.pop(key, None)  # stored now, or held before: hold it for its request
                    if key not in self.held:
                        self.manager.prepare_load([key])
                        self.held[key] = until
            else:
                self.counts["aborted_transfers"] += 1
                self._mark_gone(arrival.keys)

    def fail(self, arrival: Arrival | None, reason: str) -> None:
        if arrival is not None:
            self.end(arrival, whole=False)
        with self.lock:
            self.error = reason

    def _mark_gone(self, keys: tuple[ChunkKey, ...] | list[ChunkKey]) -> None:
        for key in keys:
            self.gone[key] = None
            self.gone.move_to_end(key)
        while len(self.gone) > 4 * self.manager.num_slots + 1024:
            self.gone.popitem(last=False)


class Receiver:
    """Reads the producer's stream into the landing zone on a thread of its own until it breaks.
    `layouts[layer]`: per plane of the layer's cache tensor, (row width, dtype)."""

    def __init__(self, channel: Channel, landing: Landing,
                 layouts: list[list[tuple[int, torch.dtype]]]) -> None:
        self.channel, self.landing, self.layouts = channel, landing, layouts
        self.thread = threading.Thread(target=self._run, name="jackfield-pd-receiver", daemon=True)
        self.thread.start()

    def join(self, timeout_s: float) -> None:
        """Wait (bounded) for the stream to end: the producer's BYE, or its timeout."""
        self.thread.join(timeout_s)

    def _run(self) -> None:
        arrival: Arrival | None = None
        try:
            while True:
                head = torch.empty(HEADER, dtype=torch.int64)
                self.channel.recv(head)
                kind, _, count, layer = head.tolist()
                if kind == Kind.HEARTBEAT:
                    continue
                if kind == Kind.BYE:
                    self.landing.fail(arrival, "pd: the producer closed the stream")
                    return
                if kind == Kind.BEGIN:
                    keys = torch.empty((count, 3), dtype=torch.int64)
                    self.channel.recv(keys)
                    if arrival is not None:  # the producer's step broke off before its END
                        self.landing.end(arrival, whole=False)
                    listed = keys.tolist()
                    arrival = self.landing.begin([ChunkKey(g, h, r) for g, h, r in listed])
                elif kind == Kind.LAYER and arrival is not None:
                    group = self.landing.layer_group[layer]
                    if count != arrival.rows[group]:
                        raise RuntimeError(f"layer {layer} sent {count} rows, the transfer announced "
                                           f"{arrival.rows[group]}")
                    data = [torch.empty((count, width), dtype=dtype) for width, dtype in self.layouts[layer]]
                    for tensor in data:
                        self.channel.recv(tensor)
                    self.landing.write(arrival, layer, data)
                elif kind == Kind.END and arrival is not None:
                    self.landing.end(arrival, whole=not arrival.layers_left)
                    arrival = None
                else:
                    raise RuntimeError(f"unexpected message kind {kind}")
        except RuntimeError as exc:
            self.landing.fail(arrival, f"pd: the producer's stream ended: {str(exc).splitlines()[0]}")

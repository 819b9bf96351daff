"""The host pool and the copies between it and the device KV cache.

The pool holds, per distinct cache tensor, `num_slots * blocks_per_chunk` rows of host memory
(pinned where CUDA exists: `jackfield.ops.staging.host_empty`); chunk slot s is rows
[s * blocks_per_chunk, (s + 1) * blocks_per_chunk). A chunk of KV cache group g fills its slot in
the tensor of each of g's layers. Copies move raw bytes, so every cache dtype (bf16, fp8)
round-trips exactly, in either layout: a cache is seen as planes of whole-block rows (MLA: one,
[blocks, bytes]; MHA: keys and values), each row read as the widest integer its bytes allow.

A copy of one layer gathers the request's blocks of each plane in one kernel into a contiguous
buffer and moves it with one host copy per run of consecutive host rows (and the reverse for a
load); the block ids are staged on the device once per request and step, not once per layer.
On CUDA, loads and stores run on two streams of their own, each ordered after the work already
queued on the compute stream; each returns an event. On a CPU-only engine the same code copies
between two host pools, synchronously.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from jackfield.attention.kv_cache import is_mla
from jackfield.contracts.kv_connector import KVConnectorContext
from jackfield.ops.staging import async_tensor_h2d, host_empty

# A transfer for one layer: (host row, device block id) pairs.
Pairs = Sequence[tuple[int, int]]


def block_planes(cache: torch.Tensor, mla: bool) -> list[torch.Tensor]:
    """The cache as contiguous [num_blocks, row] planes of whole blocks (MLA [blocks, ...]: one;
    MHA [2, blocks, ...]: keys, values), rows read as the widest integer dividing their bytes."""
    planes = [cache] if mla else [cache[0], cache[1]]
    rows = [plane.view(plane.shape[0], -1).view(torch.uint8) for plane in planes]  # views, never copies
    width = rows[0].shape[1]
    wide = next(t for t in (torch.int64, torch.int32, torch.int16, torch.uint8) if width % t.itemsize == 0)
    return [row.view(wide) for row in rows]


def runs(pairs: Pairs) -> list[tuple[int, int, int]]:
    """(first host row, end host row, index of its first pair) of each run of consecutive host rows."""
    out: list[tuple[int, int, int]] = []
    for index, (row, _) in enumerate(pairs):
        if out and out[-1][1] == row:
            out[-1] = (out[-1][0], row + 1, out[-1][2])
        else:
            out.append((row, row + 1, index))
    return out


@dataclass(frozen=True)
class StagedPairs:
    """One request's pairs of one step, ready for every layer's copy."""

    pairs: Pairs  # held so that its id, the cache key, is not reused while cached
    device_ids: torch.Tensor  # int64 [n]: the device blocks, in pair order
    runs: tuple[tuple[int, int, int], ...]


class CachePlanes:
    """The KV caches as block planes: per distinct cache tensor its planes (`block_planes`), and
    which tensor each KV cache layer uses (layers of different groups may share one)."""

    def __init__(self, context: KVConnectorContext) -> None:
        tensor_of: dict[int, int] = {}  # id of a distinct cache tensor -> its index here
        self.planes: list[list[torch.Tensor]] = []
        self.layer_tensor: list[int] = []
        for layer, cache in zip(context.layers, context.kv_caches, strict=True):
            key = id(cache)
            if key not in tensor_of:
                tensor_of[key] = len(self.planes)
                self.planes.append(block_planes(cache, is_mla(layer)))
            self.layer_tensor.append(tensor_of[key])

    def of_layer(self, layer: int) -> list[torch.Tensor]:
        return self.planes[self.layer_tensor[layer]]

    def gather(self, layer: int, device_ids: torch.Tensor) -> list[torch.Tensor]:
        """Per plane of `layer`'s tensor, its blocks `device_ids` as new contiguous rows."""
        return [plane.index_select(0, device_ids) for plane in self.of_layer(layer)]


class HostPool:
    def __init__(self, context: KVConnectorContext, blocks_per_chunk: int, num_slots: int) -> None:
        self.device = context.device
        self.blocks_per_chunk, self.num_slots = blocks_per_chunk, num_slots
        self.cache = CachePlanes(context)
        rows = num_slots * blocks_per_chunk
        self.host = [host_empty((len(planes), rows, planes[0].shape[1]), planes[0].dtype)
                     for planes in self.cache.planes]  # per distinct tensor: [planes, rows, row]
        cuda = self.device.type == "cuda"
        self.load_stream = torch.cuda.Stream(self.device) if cuda else None
        self.store_stream = torch.cuda.Stream(self.device) if cuda else None
        self._staged: dict[int, StagedPairs] = {}

    @property
    def nbytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.host)

    @staticmethod
    def chunk_bytes(context: KVConnectorContext, blocks_per_chunk: int) -> int:
        """Host bytes of one chunk slot (one chunk's blocks in every distinct cache tensor)."""
        layers = zip(context.layers, context.kv_caches, strict=True)
        distinct = {id(cache): (cache, is_mla(layer)) for layer, cache in layers}
        per_block = sum(c.numel() * c.element_size() // c.shape[0 if mla else 1]
                        for c, mla in distinct.values())
        return per_block * blocks_per_chunk

    def stage(self, pairs: Pairs) -> StagedPairs:
        """The pairs' device block ids and host runs, made once and reused by every layer until
        `end_step`."""
        staged = self._staged.get(id(pairs))
        if staged is None or staged.pairs is not pairs:
            ids = async_tensor_h2d([block for _, block in pairs], torch.int64, self.device, pin_memory=True)
            staged = StagedPairs(pairs, ids, tuple(runs(pairs)))
            self._staged[id(pairs)] = staged
        return staged

    def end_step(self) -> None:
        self._staged.clear()

    def store_layer(self, layer: int, pairs: Pairs) -> None:
        """Device blocks -> host rows for one layer (queued on the store stream on CUDA)."""
        tensor, staged = self.cache.layer_tensor[layer], self.stage(pairs)
        with self._on(self.store_stream, staged):
            gathered_planes = self.cache.gather(layer, staged.device_ids)
            for gathered, host in zip(gathered_planes, self.host[tensor], strict=True):
                for start, end, first in staged.runs:
                    host[start:end].copy_(gathered[first : first + end - start], non_blocking=True)

    def load_layer(self, layer: int, pairs: Pairs) -> None:
        """Host rows -> device blocks for one layer (queued on the load stream on CUDA)."""
        tensor, staged = self.cache.layer_tensor[layer], self.stage(pairs)
        with self._on(self.load_stream, staged):
            for plane, host in zip(self.cache.planes[tensor], self.host[tensor], strict=True):
                arrived = torch.empty((len(pairs), plane.shape[1]), dtype=plane.dtype, device=self.device)
                for start, end, first in staged.runs:
                    arrived[first : first + end - start].copy_(host[start:end], non_blocking=True)
                plane.index_copy_(0, staged.device_ids, arrived)

    def write_rows(self, layer: int, rows: torch.Tensor, data: Sequence[torch.Tensor]) -> None:
        """Host rows `rows` (int64) of `layer`'s tensor <- `data`, per plane a host tensor of
        len(rows) rows: chunks that arrived from another engine (the pd connector)."""
        for host, arrived in zip(self.host[self.cache.layer_tensor[layer]], data, strict=True):
            host.index_copy_(0, rows, arrived)

    def _on(self, stream: torch.cuda.Stream | None, staged: StagedPairs,
            ) -> torch.cuda.StreamContext | nullcontext[None]:
        """Run on `stream`, after everything already queued on the compute stream (a block being
        stored was just written; a block being loaded may have been freed by a finished request).
        The staged block ids were made on the compute stream: `end_step` drops them while `stream`
        may still be reading them, so the allocator must not hand their memory to the compute
        stream before `stream` is done (a reuse there scattered copies out of bounds on the H200)."""
        if stream is None:
            return nullcontext()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        staged.device_ids.record_stream(stream)
        return torch.cuda.stream(stream)

    def record(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """An event after the work queued on `stream` so far (None on the CPU: already done)."""
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Later compute-stream work waits for `event` (a GPU-side wait, no host sync)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def order_compute_after_stores(self) -> None:
        """Later compute-stream work (which may overwrite a stored block) waits for the stores."""
        if self.store_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.store_stream)

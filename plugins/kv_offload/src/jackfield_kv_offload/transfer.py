"""The host pool and the copies between it and the device KV cache.

The pool holds, per distinct cache tensor, `num_slots * blocks_per_chunk` blocks of host memory
(pinned where CUDA exists: `jackfield.ops.staging.host_empty`); chunk slot s is rows
[s * blocks_per_chunk, (s + 1) * blocks_per_chunk). A chunk of KV cache group g fills its slot in
the tensor of each of g's layers. Copies move raw bytes (caches viewed as uint8), so every cache
dtype (bf16, fp8) round-trips exactly, in either layout (MLA [blocks, ...], MHA [2, blocks, ...]).

On CUDA, loads and stores run on two streams of their own, each ordered after the work already
queued on the compute stream, one layer at a time, while the forward runs; each returns an event.
On a CPU-only engine the same code copies between two host pools, synchronously.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
from jackfield.attention.kv_cache import is_mla
from jackfield.contracts.kv_connector import KVConnectorContext
from jackfield.ops.staging import async_tensor_h2d, host_empty

# A transfer for one layer: (host row, device block id) pairs.
Pairs = Sequence[tuple[int, int]]


def block_major(cache: torch.Tensor, mla: bool) -> torch.Tensor:
    """The cache's bytes as [num_blocks, ...] (MHA's key/value axis moved behind the blocks)."""
    raw = cache.view(torch.uint8)
    return raw if mla else raw.transpose(0, 1)


def runs(pairs: Pairs) -> list[tuple[int, int, list[int]]]:
    """(first host row, end host row, device block ids) of each run of consecutive host rows."""
    out: list[tuple[int, int, list[int]]] = []
    for row, block in pairs:
        if out and out[-1][1] == row:
            start, _, blocks = out[-1]
            out[-1] = (start, row + 1, [*blocks, block])
        else:
            out.append((row, row + 1, [block]))
    return out


class HostPool:
    def __init__(self, context: KVConnectorContext, blocks_per_chunk: int, num_slots: int) -> None:
        self.device = context.device
        self.blocks_per_chunk, self.num_slots = blocks_per_chunk, num_slots
        tensor_of: dict[int, int] = {}  # id of a distinct cache tensor -> its index here
        self.device_views: list[torch.Tensor] = []
        self.host: list[torch.Tensor] = []
        self.layer_tensor: list[int] = []
        for layer, cache in zip(context.layers, context.kv_caches, strict=True):
            key = id(cache)
            if key not in tensor_of:
                tensor_of[key] = len(self.device_views)
                view = block_major(cache, is_mla(layer))
                self.device_views.append(view)
                self.host.append(host_empty((num_slots * blocks_per_chunk, *view.shape[1:]), torch.uint8))
            self.layer_tensor.append(tensor_of[key])
        cuda = self.device.type == "cuda"
        self.load_stream = torch.cuda.Stream(self.device) if cuda else None
        self.store_stream = torch.cuda.Stream(self.device) if cuda else None

    @staticmethod
    def chunk_bytes(context: KVConnectorContext, blocks_per_chunk: int) -> int:
        """Host bytes of one chunk slot (one chunk's blocks in every distinct cache tensor)."""
        layers = zip(context.layers, context.kv_caches, strict=True)
        distinct = {id(cache): (cache, is_mla(layer)) for layer, cache in layers}
        per_block = sum(c.numel() * c.element_size() // c.shape[0 if mla else 1]
                        for c, mla in distinct.values())
        return per_block * blocks_per_chunk

    def _ids(self, blocks: list[int]) -> torch.Tensor:
        return async_tensor_h2d(blocks, torch.int64, self.device, pin_memory=True)

    def store_layer(self, layer: int, pairs: Pairs) -> None:
        """Device blocks -> host rows for one layer (queued on the store stream on CUDA)."""
        tensor = self.layer_tensor[layer]
        device, host = self.device_views[tensor], self.host[tensor]
        with self._on(self.store_stream):
            for start, end, blocks in runs(pairs):
                host[start:end].copy_(device.index_select(0, self._ids(blocks)), non_blocking=True)

    def load_layer(self, layer: int, pairs: Pairs) -> None:
        """Host rows -> device blocks for one layer (queued on the load stream on CUDA)."""
        tensor = self.layer_tensor[layer]
        device, host = self.device_views[tensor], self.host[tensor]
        with self._on(self.load_stream):
            for start, end, blocks in runs(pairs):
                device.index_copy_(0, self._ids(blocks), host[start:end].to(self.device, non_blocking=True))

    def _on(self, stream: torch.cuda.Stream | None) -> torch.cuda.StreamContext | nullcontext[None]:
        """Run on `stream`, after everything already queued on the compute stream (a block being
        stored was just written; a block being loaded may have been freed by a finished request)."""
        if stream is None:
            return nullcontext()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(stream)

    def record(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """An event after the work queued on `stream` so far (None on the CPU: already done)."""
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def order_compute_after_stores(self) -> None:
        """Later compute-stream work (which may overwrite a stored block) waits for the stores."""
        if self.store_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.store_stream)

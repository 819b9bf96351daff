"""The CPU tier's bookkeeping, with vLLM's OffloadingManager semantics.

Each held chunk has a slot in the host pool, a readiness flag and a count of loads reading it.
- `lookup(keys)`: how many keys from the start are held and ready.
- `prepare_load(keys)`: their slots; each takes a reference, so eviction leaves it alone until
  `complete_load(keys)` drops the reference.
- `touch(keys)`: marks use in reverse order, so the prefix's first chunk ends most recent (a
  prefix's head serves more requests than its tail).
- `prepare_store(keys)`: skips keys already held, evicts unreferenced ready chunks (never the
  keys being stored) to make room, and when it cannot free enough returns None and changes
  nothing. New chunks are not ready (not found, not evictable) until `complete_store(keys, True)`;
  `complete_store(keys, False)` frees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jackfield_kv_offload.keys import ChunkKey
from jackfield_kv_offload.policies import EvictionPolicy


@dataclass
class _Chunk:
    slot: int
    ready: bool = False
    refs: int = 0


@dataclass(frozen=True)
class StorePlan:
    keys: tuple[ChunkKey, ...]  # the chunks to write (those not held before), in request order
    slots: tuple[int, ...]  # their host slots
    evicted: tuple[ChunkKey, ...]  # chunks dropped to make room


class OffloadManager:
    def __init__(self, num_slots: int, policy: EvictionPolicy) -> None:
        if num_slots < 1:
            raise ValueError(f"the CPU tier needs at least one chunk slot, got {num_slots}")
        self.num_slots = num_slots
        self.policy = policy
        self.chunks: dict[ChunkKey, _Chunk] = {}
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        count = 0
        for key in keys:
            chunk = self.chunks.get(key)
            if chunk is None or not chunk.ready:
                break
            count += 1
        return count

    def prepare_load(self, keys: Sequence[ChunkKey]) -> list[int]:
        chunks = [self.chunks.get(key) for key in keys]
        missing = [key for key, chunk in zip(keys, chunks, strict=True) if chunk is None or not chunk.ready]
        if missing:
            raise KeyError(f"cannot load chunks that are not held and ready: {missing[:4]}")
        for chunk in chunks:
            chunk.refs += 1  # type: ignore[union-attr]
        return [chunk.slot for chunk in chunks]  # type: ignore[union-attr]

    def complete_load(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            chunk = self.chunks[key]
            if chunk.refs < 1:
                raise ValueError(f"complete_load without prepare_load for {key}")
            chunk.refs -= 1

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        for key in reversed(keys):
            chunk = self.chunks.get(key)
            self.policy.touch(key, chunk is not None and chunk.ready)

    def prepare_store(self, keys: Sequence[ChunkKey]) -> StorePlan | None:
        new = [key for key in dict.fromkeys(keys) if key not in self.chunks]
        shortfall = len(new) - len(self.free_slots)
        evicted: list[ChunkKey] = []
        if shortfall > 0:
            protected = set(keys)
            victims = self.policy.evict(shortfall, lambda k: self._evictable(k) and k not in protected)
            if victims is None:
                return None
            evicted = victims
            for key in evicted:
                self.free_slots.append(self.chunks.pop(key).slot)
        slots = []
        for key in new:
            slot = self.free_slots.pop()
            self.chunks[key] = _Chunk(slot)
            self.policy.insert(key)
            slots.append(slot)
        return StorePlan(tuple(new), tuple(slots), tuple(evicted))

    def complete_store(self, keys: Sequence[ChunkKey], success: bool) -> None:
        for key in keys:
            chunk = self.chunks.get(key)
            if chunk is None or chunk.ready:
                continue
            if success:
                chunk.ready = True
            else:
                del self.chunks[key]
                self.policy.remove(key)
                self.free_slots.append(chunk.slot)

    def _evictable(self, key: ChunkKey) -> bool:
        chunk = self.chunks[key]
        return chunk.ready and chunk.refs == 0

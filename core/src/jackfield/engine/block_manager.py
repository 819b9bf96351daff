"""Paged KV blocks: a pool with reference counts, per-request block tables, prefix caching.

A full block is identified by a chained hash (its tokens and the hash of the block before it),
so equal hashes mean equal prefixes. Freed blocks keep their hash and stay findable until the
pool reuses them (least recently freed first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from jackfield.engine.sequence import Sequence


def block_hash(parent: int | None, tokens: list[int]) -> int:
    return hash((parent, tuple(tokens)))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: list[int] = field(default_factory=list)  # kept to rule out hash collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.hashes: dict[int, list[int]] = {}  # request id -> hashes of its full, computed blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold a prefix of `seq` (never its last token: that one is computed)."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        parent: int | None = None
        for start in range(0, seq.num_tokens - 1 - self.block_size + 1, self.block_size):
            tokens = seq.token_ids[start : start + self.block_size]
            h = block_hash(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].tokens != tokens:
                break
            found.append(block_id)
            parent = h
        return found

    def can_admit(self, seq: Sequence, num_new_tokens: int, hits: list[int]) -> bool:
        """Whether blocks for the cached prefix plus `num_new_tokens` can be had."""
        fresh = self.blocks_needed(len(hits) * self.block_size + num_new_tokens) - len(hits)
        reclaimed = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # hits that sit in the free pool
        return fresh <= self.num_free - reclaimed

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """Take the cached prefix blocks for `seq` (its computation starts after them)."""
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
        seq.block_table = list(hits)
        seq.num_computed = len(hits) * self.block_size
        self.hashes[seq.request_id] = [self.blocks[b].hash for b in hits]  # type: ignore[misc]

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` blocks for its first `num_tokens` tokens."""
        for _ in range(self.blocks_needed(num_tokens) - len(seq.block_table)):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None and self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.tokens, block.ref_count = None, [], 1
            seq.block_table.append(block_id)

    def commit(self, seq: Sequence) -> None:
        """Register the full blocks whose KV is now computed so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        hashes = self.hashes.setdefault(seq.request_id, [])
        for index in range(len(hashes), seq.num_computed // self.block_size):
            tokens = seq.token_ids[index * self.block_size : (index + 1) * self.block_size]
            h = block_hash(hashes[-1] if hashes else None, tokens)
            hashes.append(h)
            block = self.blocks[seq.block_table[index]]
            if block.hash is None and h not in self.cached:
                block.hash, block.tokens = h, tokens
                self.cached[h] = block.block_id

    def release(self, seq: Sequence) -> None:
        """Return `seq`'s blocks (last first, so a prefix's head outlives its tail in the pool)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        self.hashes.pop(seq.request_id, None)

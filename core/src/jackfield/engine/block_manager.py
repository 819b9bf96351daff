"""Paged KV blocks: a pool with reference counts, per-request block tables, prefix caching.

Each request holds one block table per KV cache group (see kv_groups.py); all groups draw from
one pool. A sliding-window group of window W drops the blocks that every future query of the
request has left behind (all their positions < num_computed - W + 1): their table entries become
the null block, which is never written and is masked out by the window.

A full block is identified by a chained hash (its tokens and the hash of the block before it;
the first block's parent is the configured seed, so processes with equal seeds agree: the hash
of a tuple of ints is not randomized per process), so equal hashes mean equal prefixes; the
cache is keyed by (group, hash). Freed blocks keep their hash and stay findable until the pool
reuses them (least recently freed first). A prefix hit of k blocks counts only where every group
holds what computing from token k * block_size on needs: full groups all k blocks, a window
group the blocks of the last W - 1 tokens.

The tables are also mirrored as rows of one host array (`BlockTableRows`, engine/block_table.py)
that the model runner builds a step's inputs from; every change to a table goes through here.

A hybrid model's recurrent layers keep a fixed-size state per request instead (the engine's
slot pool, engine/recurrent_state.py): with `num_state_slots`, a request takes a slot when it is
admitted and gives it back with its blocks (finished, aborted or preempted: a preempted request
is recomputed from a zero state).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from jackfield.engine.block_table import BlockTableRows
from jackfield.engine.sequence import Sequence

NULL_BLOCK = 0  # reserved when some group has a window: the entry of a dropped block


def block_hash(parent: int, tokens: list[int]) -> int:
    return hash((parent, tuple(tokens)))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: tuple[int, int] | None = None  # (group, chained hash) once registered in the cache
    tokens: list[int] = field(default_factory=list)  # kept to rule out hash collisions


def max_request_blocks(windows: Seq[int | None], block_size: int, num_tokens: int, max_chunk: int) -> int:
    """Most blocks one request of `num_tokens` holds at once over all KV cache groups, running in
    chunks of at most `max_chunk` tokens: a window group never more than its window plus a chunk."""
    whole = -(-num_tokens // block_size)
    return sum(whole if w is None else min(whole, -(-(w - 1 + max_chunk) // block_size) + 1) for w in windows)


class BlockManager:
    """`windows`: one entry per KV cache group, its sliding window (None: full attention).

    `drop_last_hit_block`: a model drafter's KV at a position depends on the token after it, which
    a block's hash does not cover; the last block of a hit is computed again instead (vLLM does
    the same for EAGLE), so the request's own next token is what the drafter's KV saw.

    `table_rows`: the array the tables are mirrored in (the model runner's; None: one of its own).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 windows: Seq[int | None] = (None,), hash_seed: int = 0,
                 drop_last_hit_block: bool = False, num_state_slots: int = 0,
                 table_rows: BlockTableRows | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        if not windows or any(w is not None and w <= 0 for w in windows):
            raise ValueError(f"need one window per KV cache group, each None or positive, got {windows}")
        if drop_last_hit_block and any(w is not None for w in windows):
            raise ValueError("drop_last_hit_block needs full-attention KV cache groups only")
        self.drop_last_hit_block = drop_last_hit_block
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self.window_groups = [group for group, w in enumerate(self.windows) if w is not None]
        self.has_null_block = any(w is not None for w in self.windows)
        if self.has_null_block and num_blocks < 2:
            raise ValueError("a sliding-window model needs at least 2 blocks (one is the null block)")
        self.blocks = [Block(i) for i in range(num_blocks)]
        first = 1 if self.has_null_block else 0
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(first, num_blocks))
        self.cached: dict[tuple[int, int], int] = {}  # (group, hash) -> block id
        self.hashes: dict[int, list[int]] = {}  # request id -> hashes of its full, computed blocks
        self.chains: dict[int, list[int]] = {}  # request id -> hashes of its full blocks so far
        if num_state_slots and enable_prefix_caching:
            raise ValueError("a recurrent state cannot be rebuilt from cached blocks: no prefix caching")
        self.uses_state_slots = num_state_slots > 0
        self.free_state_slots = list(range(num_state_slots - 1, -1, -1))  # popped from the end: 0 first
        self.table_rows = table_rows if table_rows is not None else BlockTableRows(len(self.windows))
        if self.table_rows.array.shape[0] != len(self.windows):
            raise ValueError(f"table rows for {self.table_rows.array.shape[0]} KV cache groups, "
                             f"the model has {len(self.windows)}")

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_usable(self) -> int:
        """Blocks requests can hold (all but the null block)."""
        return len(self.blocks) - self.has_null_block

    def _first_needed(self, group: int, num_computed: int) -> int:
        """Index of the first block a query at position `num_computed` (or later) still reads."""
        window = self.windows[group]
        return 0 if window is None else max(0, num_computed - window + 1) // self.block_size

    def _chain(self, seq: Sequence, num_blocks: int) -> tuple[list[list[int]], list[int]]:
        """Tokens and chained hashes of the first `num_blocks` blocks of `seq`."""
        bs = self.block_size
        chunks = [seq.token_ids[i * bs : (i + 1) * bs] for i in range(num_blocks)]
        return chunks, self.block_hashes(seq, num_blocks)

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Chained hashes of the first `num_blocks` full blocks of `seq` (kept per request and
        extended: tokens are only ever appended)."""
        chain = self.chains.setdefault(seq.request_id, [])
        bs = self.block_size
        for i in range(len(chain), num_blocks):
            parent = chain[-1] if chain else self.hash_seed
            chain.append(block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        return chain[:num_blocks]

    def _lookup(self, group: int, h: int, tokens: list[int]) -> int | None:
        block_id = self.cached.get((group, h))
        return block_id if block_id is not None and self.blocks[block_id].tokens == tokens else None

    def match_prefix(self, seq: Sequence) -> list[list[int]]:
        """Per group, the table of cached blocks that hold a prefix of `seq` (never its last
        token: that one is computed); all tables cover the same number of blocks."""
        none: list[list[int]] = [[] for _ in self.windows]
        if not self.enable_prefix_caching:
            return none
        chunks, hashes = self._chain(seq, (seq.num_tokens - 1) // self.block_size)
        # One lookup per block and group (a long prompt must not cost lookups x candidate lengths):
        # the cached block ids (None: a miss) and the running count of misses before each block.
        found = [[self._lookup(group, h, c) for h, c in zip(hashes, chunks, strict=True)]
                 for group in range(len(self.windows))]
        misses = [list(itertools.accumulate((b is None for b in ids), initial=0)) for ids in found]
        for k in range(len(hashes), 0, -1):  # the longest hit every group can serve
            firsts = [self._first_needed(group, k * self.block_size) for group in range(len(self.windows))]
            if all(m[k] == m[first] for m, first in zip(misses, firsts, strict=True)):
                tables = [[NULL_BLOCK] * first + found[group][first:k]  # type: ignore[list-item]
                          for group, first in enumerate(firsts)]
                return [table[:-1] for table in tables] if self.drop_last_hit_block else tables
        return none

    def can_admit(self, num_new_tokens: int, hits: list[list[int]]) -> bool:
        """Whether blocks for the cached prefix plus `num_new_tokens` can be had."""
        cached = len(hits[0]) * self.block_size
        fresh = sum(self.blocks_needed(cached + num_new_tokens) - len(table) for table in hits)
        reclaimed = sum(1 for table in hits for b in self._real(table) if self.blocks[b].ref_count == 0)
        if self.uses_state_slots and not self.free_state_slots:
            return False
        return fresh <= self.num_free - reclaimed  # hits that sit in the free pool are not fresh

    def admit(self, seq: Sequence, hits: list[list[int]]) -> None:
        """Take the cached prefix blocks for `seq` (its computation starts after them)."""
        for table in hits:
            for block_id in self._real(table):
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free[block_id]
                block.ref_count += 1
        seq.block_tables = [list(table) for table in hits]
        seq.table_row = self.table_rows.take_row()
        self.table_rows.extend(seq.table_row, seq.block_tables)
        if self.uses_state_slots:
            seq.state_slot = self.free_state_slots.pop()
        seq.num_computed = len(hits[0]) * self.block_size
        self.hashes[seq.request_id] = self._chain(seq, len(hits[0]))[1]

    def trim(self, seq: Sequence) -> None:
        """Hand back window-group blocks no query of `seq` from num_computed on can see."""
        if not seq.block_tables:
            return
        for group in self.window_groups:
            table = seq.block_tables[group]
            end = min(self._first_needed(group, seq.num_computed), len(table))
            if end == 0 or table[end - 1] == NULL_BLOCK:
                continue  # nothing left the window since the last trim
            start = end - 1
            while start > 0 and table[start - 1] != NULL_BLOCK:  # earlier ones were dropped before
                start -= 1
            for i in range(start, end):
                self._unref(table[i])
                table[i] = NULL_BLOCK
            self.table_rows.clear(seq.table_row, group, start, end)  # type: ignore[arg-type]

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        held = len(seq.block_tables[0]) if seq.block_tables else 0  # every table has one length
        return (self.blocks_needed(num_tokens) - held) * len(self.windows) <= len(self.free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` blocks for its first `num_tokens` tokens in every group."""
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.windows]
        if seq.table_row is None:
            seq.table_row = self.table_rows.take_row()
        needed = self.blocks_needed(num_tokens)
        if len(seq.block_tables[0]) >= needed:  # every table has one length
            return
        for table in seq.block_tables:
            for _ in range(needed - len(table)):
                block_id, _ = self.free.popitem(last=False)
                block = self.blocks[block_id]
                if block.key is not None and self.cached.get(block.key) == block_id:
                    del self.cached[block.key]
                block.key, block.tokens, block.ref_count = None, [], 1
                table.append(block_id)
        self.table_rows.extend(seq.table_row, seq.block_tables)

    def commit(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Register the full blocks among the first `num_tokens` (default: num_computed), whose
        KV is computed, so later requests can share them. (Runs after every step, before the next
        `trim`, so no window has dropped them yet; under async scheduling the next step's trim
        came first, and a window group's block that it dropped is not registered.)"""
        if not self.enable_prefix_caching:
            return
        hashes = self.hashes.setdefault(seq.request_id, [])
        num_blocks = (seq.num_computed if num_tokens is None else num_tokens) // self.block_size
        if num_blocks <= len(hashes):
            return  # no block filled since the last commit (most decode steps)
        chain = self.block_hashes(seq, num_blocks)
        for index in range(len(hashes), len(chain)):
            tokens = seq.token_ids[index * self.block_size : (index + 1) * self.block_size]
            h = chain[index]
            hashes.append(h)
            for group, table in enumerate(seq.block_tables):
                if self.has_null_block and table[index] == NULL_BLOCK:
                    continue  # a window block dropped before it was committed (a connector load)
                block = self.blocks[table[index]]
                if block.key is None and (group, h) not in self.cached:
                    block.key, block.tokens = (group, h), tokens
                    self.cached[group, h] = block.block_id

    def release(self, seq: Sequence) -> None:
        """Return `seq`'s blocks (last first, so a prefix's head outlives its tail in the pool)."""
        for table in seq.block_tables:
            for block_id in reversed(self._real(table)):
                self._unref(block_id)
        seq.block_tables = []
        if seq.table_row is not None:
            self.table_rows.free_row(seq.table_row)
            seq.table_row = None
        if seq.state_slot is not None:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None
        self.hashes.pop(seq.request_id, None)
        self.chains.pop(seq.request_id, None)

    def _real(self, table: list[int]) -> list[int]:
        """The table's blocks, less null entries."""
        return [b for b in table if b != NULL_BLOCK] if self.has_null_block else table

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None

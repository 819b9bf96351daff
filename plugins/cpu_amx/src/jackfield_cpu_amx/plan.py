"""The per-step plan: everything every layer of a step shares, computed once in build().

Requests are cut into groups. A group is a run of consecutive requests with the same query
length (decode and prefill requests never share one), within budgets of gathered keys (the
gather buffer's size) and mask entries (requests x query rows x keys). Each group's query rows
are contiguous, so its queries fold into one [g, q_len * H, D] batch: every product has
q_len * H >= 16 rows (one AMX tile height) whenever H >= 16, or several tokens of H >= 8 heads.
Each request's keys are cut into chunks of whole blocks, each chunk one task of the fused
attention kernel. The block size is a property of the cache, not of the metadata, so the gather
layout (block ids, never-written rows, masks) is resolved for it once per step, on the first
layer, and reused by the rest; likewise per sliding window (a property of the layer: a windowed
layout starts at the first block the window reaches).
MLA and MHA layers read the same plan.

Decode groups (q_len <= NATIVE_MAX_Q_LEN) also carry what the native AMX kernel reads instead
(native/mla_decode.c reads the cache in place through the block table, no gather): int32 tables
built here, and a split of each request's keys memoized per (block size, heads, threads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from jackfield.contracts.attention import AttentionMetadata, AttentionMetadataBuilder

PLANS_KEY = "cpu_amx_plans"
MIN_CHUNK_KEYS = 256
# One group for B=16 x S=4096 (75 MB of bf16 records gathered): on the AMX host at H=16 one group
# beat 4 and 16 smaller ones (2.5-2.9 against 3.5-7.6 ms, benchmarks/RESULTS.md), each fused-kernel
# call costing ~0.3 ms beyond its share of the work. The bmm kernel slices a group itself.
DEFAULT_GROUP_KEYS = 65536
# A group's masks hold num_reqs x q_len x keys float32 entries: 16 MB at most, so prefills of long
# prompts go one request (or a few) per group.
DEFAULT_GROUP_MASK_ENTRIES = 1 << 22
FUSED_MAX_ROWS = 32  # the flash kernel's query slice for short queries (see kernels.py)
NATIVE_MAX_Q_LEN = 8  # decode (speculative tokens included); longer queries are prefill
NATIVE_CHUNK_KEYS = 64  # CHUNK_KEYS of native/mla_decode.c: splits start at its multiples
NATIVE_TILE_ROWS = 16  # query rows per native work item (one AMX tile height)
# Native work items per thread, where the keys allow: on the AMX host (B=16, S=4096, H=16), in two
# runs 4 per thread took 1.26 / 1.15 ms with the cache in L3 and 1.57 / 1.56 ms evicted, 1 per
# thread 1.34 / 1.28 and 1.79 / 1.78 ms (dynamic scheduling evens out slower cores).
NATIVE_ITEMS_PER_THREAD = 4
PlanKey = tuple[int, int, int]  # (num_reqs, num_tokens, num_decodes) of the metadata a plan serves


def plan_key(metadata: AttentionMetadata) -> PlanKey:
    return (metadata.num_reqs, metadata.num_tokens, metadata.num_decodes)


@dataclass
class Scratch:
    """Gather buffers reused across layers and steps (the run-time builder's own)."""

    buffers: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def get(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buf = self.buffers.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype)
            self.buffers[dtype] = buf
        return buf[:numel]


@dataclass(frozen=True)
class KeyChunks:
    """A group's gather layout for one block size (and sliding window): each request's keys as
    num_chunks equal chunks of whole blocks, from the first block its queries' window reaches
    (block 0 without a window); blocks past a request's own repeat its first (read, then masked)."""

    num_chunks: int
    blocks_per_req: int  # num_chunks * blocks per chunk
    block_ids: torch.Tensor  # [num_reqs * blocks_per_req] int64 physical blocks to gather
    stale_rows: torch.Tensor  # int64 gathered records at or past their request's seq_len
    # [num_reqs, num_chunks, q_len, chunk keys] float32: 0 visible, -inf hidden; None: all visible,
    # or (kernel_causal) the flash kernel's own causal mask
    mask: torch.Tensor | None
    # [num_reqs, num_chunks, q_len, 1] float32: -inf where a row sees no key; None: every row sees one
    chunk_bias: torch.Tensor | None
    block_span: tuple[int, int]  # smallest and largest block id read, checked against each cache
    # Causal with every seq_len equal to q_len (a fresh prefill) and one chunk: query row i sees
    # keys 0..i, the kernel's is_causal mask, which also skips the hidden key tiles.
    kernel_causal: bool = False
    _row_masks: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    _gathers: dict[tuple[int, int, int, int], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def gather_index(self, num_blocks: int, block_size: int, parts: int,
                     halves: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(row ids, stale records) of the gather from a cache of `halves` x num_blocks blocks of
        block_size records (an MHA cache: its keys, then its values), each block read as `parts`
        rows: the rows to read, and the gathered records past their request's seq_len (to zero).
        Memoized: every layer of a step reads caches of one shape."""
        key = (num_blocks, block_size, parts, halves)
        found = self._gathers.get(key)
        if found is None:
            block_ids = torch.cat([self.block_ids + h * num_blocks for h in range(halves)])
            rows = (block_ids[:, None] * parts + torch.arange(parts)).view(-1) if parts > 1 else block_ids
            per_half = self.block_ids.numel() * block_size
            stale = torch.cat([self.stale_rows + h * per_half for h in range(halves)])
            found = self._gathers[key] = (rows, stale)
        return found

    def row_mask(self, rows_per_token: int) -> torch.Tensor | None:
        """The mask with each query token's row repeated for `rows_per_token` consecutive rows:
        [num_reqs * num_chunks, 1, q_len * rows_per_token, chunk keys], memoized (a view when
        q_len is 1, a copy otherwise, made once per step rather than once per layer)."""
        if self.mask is None:
            return None
        mask = self._row_masks.get(rows_per_token)
        if mask is None:
            g, n, q_len, keys = self.mask.shape
            mask = self._row_masks[rows_per_token] = (
                self.mask.view(g * n, 1, q_len, 1, keys)
                .expand(-1, -1, -1, rows_per_token, -1)
                .reshape(g * n, 1, q_len * rows_per_token, keys)
            )
        return mask


@dataclass(frozen=True)
class DecodeRows:
    """A one-token-a-request group's visible keys, gathered record by record (not block by block):
    request r's keys at positions [first_r, seq_len_r), first_r = 0 or where its query's window
    starts, padded to the longest such run with repeats of its first key. Every record read was
    written, so nothing gathered needs zeroing (a block gather reads never-written slots, which may
    hold NaN); only the repeats are masked."""

    num_keys: int  # keys per request after padding
    row_ids: torch.Tensor  # [2 * num_reqs * num_keys] int64 rows of the [2 * blocks * block_size,
    # H_kv * D] view of an MHA cache: the keys', then the values'
    mask: torch.Tensor | None  # [num_reqs, 1, 1, num_keys] float32, -inf on the repeats; None: none
    block_span: tuple[int, int]  # smallest and largest block id read, checked against each cache


@dataclass(frozen=True)
class DecodeTables:
    """What the native decode kernel reads besides the query, the cache and the outputs: int32,
    contiguous, built once per step."""

    q_len: int
    block_table: torch.Tensor  # [num_reqs, max_blocks]
    seq_lens: torch.Tensor  # [num_reqs]
    visible_keys: torch.Tensor  # [num_reqs * q_len]: how many keys the rows of each query token see


@dataclass(frozen=True)
class NativeLayout:
    """A decode group's work split for the native kernel, for one block size, head and thread
    count, and the tables it was made for (the kernel is handed exactly those)."""

    block_size: int
    num_splits: int  # key splits per (request, 16-row group), merged through their LSEs
    split_keys: int  # keys per split, a multiple of NATIVE_CHUNK_KEYS
    block_span: tuple[int, int]  # smallest and largest block id the requests own
    num_keys: int  # the longest seq_len of the requests
    tables: DecodeTables = field(compare=False, repr=False)

    def __post_init__(self) -> None:
        # The C kernel reads whole 64-key chunks of each split and trusts the splits to cover
        # every request: a layout that does not is refused here, not read past there.
        if (self.block_size <= 0 or self.split_keys <= 0 or self.split_keys % NATIVE_CHUNK_KEYS
                or self.num_splits < 1 or self.num_splits * self.split_keys < self.num_keys):
            raise ValueError(
                f"native layout: {self.num_splits} splits of {self.split_keys} keys (whole chunks of "
                f"{NATIVE_CHUNK_KEYS}) for {self.num_keys} keys in blocks of {self.block_size}"
            )


@dataclass(frozen=True)
class RequestGroup:
    req_start: int  # first request, relative to the metadata the plan serves
    num_reqs: int
    token_start: int
    q_len: int
    num_keys: int  # keys read per request: the longest seq_len in the group
    chunk_keys: int  # about this many keys per chunk
    causal: bool
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32 rows of this group
    seq_lens: torch.Tensor  # [num_reqs] int64
    decode_tables: DecodeTables | None  # for the native kernel; None past NATIVE_MAX_Q_LEN
    # (block size, split, sliding window, kernel_causal) -> layout
    _chunks: dict[tuple[int, bool, int | None, bool], KeyChunks] = field(
        default_factory=dict, compare=False, repr=False
    )
    _native: dict[tuple[int, int, int], NativeLayout] = field(default_factory=dict, compare=False, repr=False)
    # (block size, blocks in the cache, sliding window) -> rows
    _decode_rows: dict[tuple[int, int, int | None], DecodeRows] = field(
        default_factory=dict, compare=False, repr=False
    )

    def decode_rows(self, block_size: int, num_blocks: int, sliding_window: int | None) -> DecodeRows:
        """The gather of a group of one query token a request (DecodeRows), memoized: every layer
        of a step reads caches of one shape, and the window is the layer's."""
        key = (block_size, num_blocks, sliding_window)
        rows = self._decode_rows.get(key)
        if rows is None:
            rows = self._decode_rows[key] = self._decode_rows_for(block_size, num_blocks, sliding_window)
        return rows

    def _decode_rows_for(self, block_size: int, num_blocks: int, sliding_window: int | None) -> DecodeRows:
        if self.q_len != 1:
            raise ValueError(f"decode rows serve one query token a request, the group has {self.q_len}")
        owned_blocks = -(-self.seq_lens // block_size)
        if int(owned_blocks.max()) > self.block_table.shape[1]:
            raise ValueError(
                f"block_table has {self.block_table.shape[1]} columns, seq_len {self.num_keys} "
                f"needs {int(owned_blocks.max())} blocks of {block_size}"
            )
        # The query at position n - 1 sees keys > n - 1 - window (causal or not: none come after it).
        first = torch.zeros_like(self.seq_lens)
        if sliding_window is not None:
            first = (self.seq_lens - sliding_window).clamp_(min=0)
        counts = self.seq_lens - first
        num_keys = int(counts.max())
        offsets = torch.arange(num_keys)
        visible = offsets < counts[:, None]
        positions = first[:, None] + torch.where(visible, offsets, 0)  # [num_reqs, num_keys]
        blocks = self.block_table.long().gather(1, positions // block_size)
        slots = (blocks * block_size + positions % block_size).view(-1)
        row_ids = torch.cat((slots, slots + num_blocks * block_size))
        mask = None
        if not bool(visible.all()):
            mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
            mask = mask.view(self.num_reqs, 1, 1, num_keys)
        return DecodeRows(num_keys, row_ids, mask, (int(blocks.min()), int(blocks.max())))

    def native_layout(self, block_size: int, num_heads: int, num_threads: int) -> NativeLayout:
        """Enough (request, 16-row group, split) work items for NATIVE_ITEMS_PER_THREAD per thread,
        splits of whole chunks; memoized (the block size is the cache's, the heads the layer's)."""
        key = (block_size, num_heads, num_threads)
        layout = self._native.get(key)
        if layout is None:
            layout = self._native[key] = self._native_layout(block_size, num_heads, num_threads)
        return layout

    def _native_layout(self, block_size: int, num_heads: int, num_threads: int) -> NativeLayout:
        owned_blocks = -(-self.seq_lens // block_size)
        if int(owned_blocks.max()) > self.block_table.shape[1]:
            raise ValueError(
                f"block_table has {self.block_table.shape[1]} columns, seq_len {self.num_keys} "
                f"needs {int(owned_blocks.max())} blocks of {block_size}"
            )
        owned = self.block_table[torch.arange(self.block_table.shape[1]) < owned_blocks[:, None]]
        span = (int(owned.min()), int(owned.max())) if owned.numel() else (0, 0)
        items = self.num_reqs * -(-self.q_len * num_heads // NATIVE_TILE_ROWS)
        chunks = max(1, -(-self.num_keys // NATIVE_CHUNK_KEYS))
        splits = min(chunks, -(-NATIVE_ITEMS_PER_THREAD * num_threads // items))
        split_keys = -(-chunks // splits) * NATIVE_CHUNK_KEYS
        assert self.decode_tables is not None, "native layouts serve decode groups"
        num_splits = max(1, -(-self.num_keys // split_keys))
        return NativeLayout(block_size, num_splits, split_keys, span, self.num_keys, self.decode_tables)

    def key_chunks(
        self,
        block_size: int,
        split: bool = True,
        sliding_window: int | None = None,
        kernel_causal: bool = False,
    ) -> KeyChunks:
        """The gather layout (one chunk per request unless `split`), memoized per block size (a
        property of the cache, not of the metadata) and window (a property of the layer).
        `kernel_causal`: the caller's kernel applies KeyChunks.kernel_causal where it holds."""
        key = (block_size, split, sliding_window, kernel_causal)
        chunks = self._chunks.get(key)
        if chunks is None:
            chunk_blocks = -(-self.chunk_keys // block_size) if split else None  # whole blocks, rounded up
            chunks = self._chunks[key] = self._layout(block_size, chunk_blocks, sliding_window, kernel_causal)
        return chunks

    def _layout(
        self, block_size: int, chunk_blocks: int | None, sliding_window: int | None, kernel_causal: bool
    ) -> KeyChunks:
        owned_blocks = -(-self.seq_lens // block_size)
        if int(owned_blocks.max()) > self.block_table.shape[1]:
            raise ValueError(
                f"block_table has {self.block_table.shape[1]} columns, seq_len {self.num_keys} "
                f"needs {int(owned_blocks.max())} blocks of {block_size}"
            )
        if sliding_window is None:
            first_block = torch.zeros_like(self.seq_lens)
        else:  # the block of the first key the first query row's window reaches
            first_key = self.seq_lens - self.q_len - sliding_window + 1
            first_block = first_key.clamp_(min=0) // block_size
        num_blocks = int((owned_blocks - first_block).max())
        num_chunks = 1 if chunk_blocks is None else -(-num_blocks // chunk_blocks)
        padded = num_chunks * -(-num_blocks // num_chunks)  # equal chunks, fewest padding blocks
        columns = first_block[:, None] + torch.arange(padded)
        owned = columns < owned_blocks[:, None]
        table = self.block_table.long()
        ids = torch.where(
            owned,
            table.gather(1, columns.clamp(max=table.shape[1] - 1)),
            table.gather(1, first_block[:, None]),
        )
        # Never-written slots may hold NaN; a masked key still multiplies its value by 0.
        key_pos = first_block[:, None] * block_size + torch.arange(padded * block_size)
        stale = (key_pos >= self.seq_lens[:, None]).view(-1).nonzero().view(-1)
        span = (int(ids.min()), int(ids.max())) if ids.numel() else (0, 0)
        if (kernel_causal and self.causal and sliding_window is None and num_chunks == 1
                and bool((self.seq_lens == self.q_len).all())):
            return KeyChunks(1, padded, ids.reshape(-1), stale, None, None, span, kernel_causal=True)
        bias = _key_bias(self.seq_lens, self.q_len, key_pos, self.causal, sliding_window)
        mask = bias.view(self.num_reqs, self.q_len, num_chunks, -1).transpose(1, 2).contiguous()
        blind = (mask == float("-inf")).all(-1, keepdim=True)
        chunk_bias = torch.zeros(blind.shape).masked_fill_(blind, float("-inf")) if blind.any() else None
        visible_mask = None if bool((mask == 0).all()) else mask
        return KeyChunks(num_chunks, padded, ids.reshape(-1), stale, visible_mask, chunk_bias, span)


@dataclass(frozen=True)
class StepPlan:
    groups: tuple[RequestGroup, ...]
    num_reqs: int
    num_tokens: int
    fused_max_rows: int  # a group with at most this many query rows per request uses the fused kernel

    def __post_init__(self) -> None:
        # attend() writes its outputs only through the groups (no NaN poison fill: a parallel op
        # per output, which the AMX host's profile put at tens of us each, though an A/B of the
        # 2.4 ms step could not tell the difference from noise), so the groups must tile the rows.
        end = 0
        for group in self.groups:
            if group.token_start != end:
                raise ValueError(f"request group at query row {group.token_start}, expected {end}")
            end += group.num_reqs * group.q_len
        if end != self.num_tokens:
            raise ValueError(f"request groups cover {end} query rows of {self.num_tokens}")

    def fused(self, group: RequestGroup, num_heads: int, compute_dtype: torch.dtype) -> bool:
        """The fused kernel for few query rows, and always for 16-bit products: the bmm kernel's
        scores come out of its product in the product's dtype, and bfloat16 scores (an ulp of
        0.125 at 16-32) would skew the softmax; the fused kernel accumulates them in float32."""
        return group.q_len * num_heads <= self.fused_max_rows or compute_dtype != torch.float32


def _key_bias(
    seq_lens: torch.Tensor, q_len: int, key_pos: torch.Tensor, causal: bool, sliding_window: int | None
) -> torch.Tensor:
    """[num_reqs, q_len, keys] float32, 0 where visible, -inf where hidden, for keys at positions
    key_pos [num_reqs, keys]. Query row i of a request with seq_len n sits at p = n - q_len + i; it
    sees keys < n (non-causal) or <= p (causal), and of those only keys > p - window."""
    row_pos = seq_lens[:, None] - q_len + torch.arange(q_len)  # [num_reqs, q_len]
    keys = key_pos[:, None, :]
    visible_end = (row_pos + 1 if causal else seq_lens[:, None].expand(-1, q_len))[:, :, None]
    visible = keys < visible_end
    if sliding_window is not None:
        visible &= keys > row_pos[:, :, None] - sliding_window
    return torch.zeros(visible.shape, dtype=torch.float32).masked_fill_(~visible, float("-inf"))


def _decode_tables(
    block_table: torch.Tensor, seq_lens: torch.Tensor, q_len: int, causal: bool
) -> DecodeTables | None:
    """The native kernel's int32 tables; token i of a request with seq_len n sees n - (q_len - 1 - i)
    keys when causal, n when not (as _key_bias)."""
    if q_len > NATIVE_MAX_Q_LEN:
        return None
    behind_last = torch.arange(q_len) - (q_len - 1) if causal else torch.zeros(q_len, dtype=torch.long)
    visible = (seq_lens[:, None] + behind_last).clamp_(min=0)
    return DecodeTables(
        q_len=q_len,
        block_table=block_table.to(torch.int32).contiguous(),
        seq_lens=seq_lens.to(torch.int32).contiguous(),
        visible_keys=visible.to(torch.int32).reshape(-1).contiguous(),
    )


class CpuAmxMetadataBuilder(AttentionMetadataBuilder):
    """Builds the plan of the metadata it is given: the engine divides an MLA batch by role and
    builds each half with its role's own builder, so a build serves exactly one `attend` batch."""

    def __init__(
        self,
        group_keys: int = DEFAULT_GROUP_KEYS,
        chunk_keys: int | None = None,
        fused_max_rows: int = FUSED_MAX_ROWS,
        group_mask_entries: int = DEFAULT_GROUP_MASK_ENTRIES,
    ) -> None:
        self.group_keys = group_keys  # keys gathered per group: bounds the working set
        self.group_mask_entries = group_mask_entries
        self.chunk_keys = chunk_keys  # keys per attention task (split-K); None: by thread count
        self.fused_max_rows = fused_max_rows
        self.scratch = Scratch()

    def _chunk_keys(self, num_reqs: int, num_keys: int) -> int:
        """Enough (request, chunk) tasks for one per thread, none shorter than MIN_CHUNK_KEYS: the
        chunks' partial outputs cost a merge, and on the AMX host 16 tasks of 4096 keys beat 32 of
        2048 (2.52 against 2.75 ms at B=16, H=16)."""
        if self.chunk_keys is not None:
            return self.chunk_keys
        return max(MIN_CHUNK_KEYS, -(-num_reqs * num_keys // torch.get_num_threads()))

    def build(self, common: AttentionMetadata, for_capture: bool = False) -> AttentionMetadata:
        qsl = common.query_start_loc_cpu.long()
        q_lens = qsl.diff()
        seq_lens = common.seq_lens_cpu.long()
        block_table = common.block_table.cpu()
        groups = self._groups(q_lens.tolist(), seq_lens.tolist(), common.num_decodes)
        full = [
            RequestGroup(
                req_start=r0,
                num_reqs=r1 - r0,
                token_start=int(qsl[r0]),
                q_len=int(q_lens[r0]),
                num_keys=int(seq_lens[r0:r1].max()),
                chunk_keys=self._chunk_keys(r1 - r0, int(seq_lens[r0:r1].max())),
                causal=common.causal,
                block_table=block_table[r0:r1],
                seq_lens=seq_lens[r0:r1],
                decode_tables=_decode_tables(
                    block_table[r0:r1], seq_lens[r0:r1], int(q_lens[r0]), common.causal
                ),
            )
            for r0, r1 in groups
        ]
        plans: dict[PlanKey, StepPlan] = {
            plan_key(common): StepPlan(tuple(full), common.num_reqs, common.num_tokens, self.fused_max_rows)
        }
        scratch = Scratch() if for_capture else self.scratch
        return common.replace(extra={**common.extra, PLANS_KEY: plans, "cpu_amx_scratch": scratch})

    def _groups(self, q_lens: list[int], seq_lens: list[int], num_decodes: int) -> list[tuple[int, int]]:
        """[start, end) request ranges: equal q_len, one side of the decode boundary, within the
        budgets of gathered keys and mask entries."""
        groups: list[tuple[int, int]] = []
        start, longest = 0, 0
        for r, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
            keys = max(longest, seq_len) * (r - start + 1)
            if r > start and (
                q_len != q_lens[start]
                or r == num_decodes
                or keys > self.group_keys
                or keys * q_len > self.group_mask_entries
            ):
                groups.append((start, r))
                start, longest = r, 0
            longest = max(longest, seq_len)
        if start < len(q_lens):
            groups.append((start, len(q_lens)))
        return [(r0, r1) for r0, r1 in groups if q_lens[r0] > 0]


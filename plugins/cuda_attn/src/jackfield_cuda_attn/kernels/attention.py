"""Paged attention for MHA, GQA and MQA: one kernel family for every step shape.

Layout (jackfield.contracts.attention): query [T, H, D]; cache [2, blocks, block_size, H_kv, D];
request b owns query rows qsl[b]:qsl[b+1] and seq_lens[b] keys, its query row i sits at position
seq_len - q_len + i. Query head h reads KV head h // (H // H_kv).

A program serves one KV head and a chunk of the query heads that share it (HEADS of them, a power
of two; all of them unless that would make the tile too tall). Its tile's row m is query row
m // HEADS and head m % HEADS of the chunk, so each KV tile is read once for the whole group and
multi-token decode rows ride along in the same tile.

- Decode (every request's query length <= 8): program (request, head chunk, split). The keys a
  request's rows can see are divided into `num_splits` ranges on the device (from its seq_len),
  so lengths and tables are read only there and a CUDA graph can replay the step with new ones.
  With one split the program writes the output; with more, each writes a normalized partial and
  its LSE, and `_merge_kernel` combines them (with the sinks).
- Prefill and mixed steps: FlashAttention-2-style tiles of BLOCK_Q query rows (x the head chunk)
  with an online softmax. Each program finds its request by a binary search over qsl on the
  device (request b's blocks start at (qsl[b] - qsl[0]) // BLOCK_Q + b), skips the KV tiles it
  cannot see (causal future, outside the window) and masks only the tiles on an edge. Programs are
  issued last block first: the causal blocks with the most work start early.

Softmax runs in base 2 (scores scaled by log2(e)); LSE is returned in natural log, float32, -inf
for rows that saw no key (those give output 0). Sinks join the denominator only. fp8 caches are
dequantized by folding the key scale (kv_scale[0]) into the score scale and the value scale
(kv_scale[1]) into the output.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from jackfield.ops.launch import DirectLauncher

from jackfield_cuda_attn.kernels.checks import (
    FP8,
    QUERY_DTYPES,
    check_cache,
    check_device,
    check_scale,
    require,
)

MAX_DECODE_QUERY_LEN = 8
LOG2E = 1.4426950408889634
# Split-KV decode: enough programs for two per SM, each split at least MIN_SPLIT_KEYS keys long.
PROGRAMS_PER_SM = 2
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 64
DECODE_MAX_TILE_ROWS = 64  # query rows x heads of one decode tile (accumulator registers)


@triton.jit
def _attend_tiles(
    acc,
    l_i,
    m_i,
    q,
    k_head,
    v_head,
    table_row,
    tile_lo,
    tile_hi,
    kv_hi,
    pos,
    qk_scale,
    window,
    stride_slot,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BS: tl.constexpr,
    D: tl.constexpr,
):
    """Online softmax over KV tiles tile_lo..tile_hi-1 (of BLOCK_N keys) of one request and head.

    MASKED: tiles on an edge (keys >= kv_hi, causal future, outside the window); otherwise every
    key of every tile is visible to every row and nothing is masked.
    """
    d = tl.arange(0, D)
    for t in range(tile_lo, tile_hi):
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        if MASKED:
            in_range = n < kv_hi
            page = tl.load(table_row + n // BS, mask=in_range, other=0).to(tl.int64)
            where = ((page * BS + n % BS) * stride_slot)[:, None] + d[None, :]
            k = tl.load(k_head + where, mask=in_range[:, None], other=0.0)
            v = tl.load(v_head + where, mask=in_range[:, None], other=0.0)
        else:
            page = tl.load(table_row + n // BS).to(tl.int64)
            where = ((page * BS + n % BS) * stride_slot)[:, None] + d[None, :]
            k = tl.load(k_head + where)
            v = tl.load(v_head + where)
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
        if MASKED:
            visible = in_range[None, :]
            if CAUSAL:
                visible = visible & (n[None, :] <= pos[:, None])
            if HAS_WINDOW:
                visible = visible & (n[None, :] > pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet stay at 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _store_rows(
    acc,
    l_i,
    m_i,
    out_ptrs,
    lse_ptrs,
    row_live,
    head,
    sinks,
    kv_scale,
    HAS_SINKS: tl.constexpr,
    FP8: tl.constexpr,
):
    """Normalize (with the sink in the denominator) and write output and natural-log LSE."""
    seen = l_i > 0
    m_top = tl.where(seen, m_i, 0.0)
    if HAS_SINKS:
        sink = tl.load(sinks + head, mask=row_live, other=0.0) * 1.4426950408889634
        m_top = tl.where(seen, tl.maximum(m_i, sink), 0.0)
        kept = tl.exp2(tl.where(seen, m_i, 0.0) - m_top)
        l_i = tl.where(seen, l_i * kept + tl.exp2(sink - m_top), 0.0)
        acc = acc * kept[:, None]
    total = tl.where(seen, l_i, 1.0)
    o = acc / total[:, None]
    if FP8:  # values are stored divided by their scale (kv_scale[1])
        o = o * tl.load(kv_scale + 1)
    tl.store(out_ptrs, o.to(out_ptrs.dtype.element_ty), mask=row_live[:, None])
    lse = tl.where(seen, (m_top + tl.log2(total)) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptrs, lse, mask=row_live)


# Per-step integers (request and split counts, block-table widths, the split buffers' strides)
# are not specialized: Triton would compile a variant per divisibility class of each, and a
# serving engine meets new step shapes for a long time (compiles of 0.5-2 s inside requests).
@triton.jit(do_not_specialize=["num_splits", "stride_bt", "stride_split_out", "stride_split_lse", "window"])
def _decode_kernel(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    query_start,
    sinks,
    kv_scale,
    out,
    lse,
    part_out,
    part_lse,
    qk_scale,
    window,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_bt,
    stride_slot,
    stride_split_out,
    stride_split_lse,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BS: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    FP8: tl.constexpr,
    SPLIT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1) // NUM_CHUNKS
    chunk = tl.program_id(1) % NUM_CHUNKS
    split = tl.program_id(2)
    q_start = tl.load(query_start + b)
    q_len = tl.load(query_start + b + 1) - q_start
    seq_len = tl.load(seq_lens + b)

    m = tl.arange(0, BLOCK_M)
    qi = m // HEADS
    g = chunk * HEADS + m % HEADS
    row_live = (qi < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    row = (q_start + qi).to(tl.int64)
    pos = seq_len - q_len + qi
    d = tl.arange(0, D)
    q_ptrs = q + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q_tile = tl.load(q_ptrs, mask=row_live[:, None], other=0.0)

    # This split's share of the tiles the request's rows can see (all computed on the device).
    tile_lo = 0
    if HAS_WINDOW:
        tile_lo = tl.maximum(seq_len - q_len - window + 1, 0) // BLOCK_N
    tile_end = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(tl.maximum(tile_end - tile_lo, 0), num_splits)
    first = tile_lo + split * per_split
    last = tl.minimum(first + per_split, tile_end)

    if FP8:  # keys are stored divided by their scale (kv_scale[0])
        qk_scale = qk_scale * tl.load(kv_scale)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q_tile, k_cache + kvh * D, v_cache + kvh * D, block_table + b * stride_bt,
        first, last, seq_len, pos, qk_scale, window, stride_slot,
        True, CAUSAL, HAS_WINDOW, BLOCK_N, BS, D,
    )  # fmt: skip

    if SPLIT:  # a normalized partial and its base-2 LSE; _merge_kernel adds sinks and scales
        seen = l_i > 0
        o = acc / tl.where(seen, l_i, 1.0)[:, None]
        if FP8:
            o = o * tl.load(kv_scale + 1)
        at = row * NUM_HEADS + head
        part_ptrs = part_out + split * stride_split_out + at[:, None] * D + d[None, :]
        tl.store(part_ptrs, o, mask=row_live[:, None])
        part = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(part_lse + split * stride_split_lse + at, part, mask=row_live)
    else:
        out_ptrs = out + row[:, None] * stride_ot + head[:, None] * D + d[None, :]
        _store_rows(acc, l_i, m_i, out_ptrs, lse + row * NUM_HEADS + head, row_live, head, sinks, kv_scale,
                    HAS_SINKS, FP8)  # fmt: skip


@triton.jit(do_not_specialize=["num_splits", "stride_split_out", "stride_split_lse"])
def _merge_kernel(
    part_out,
    part_lse,
    sinks,
    out,
    lse,
    num_splits,
    stride_split_out,
    stride_split_lse,
    stride_ot,
    NUM_HEADS: tl.constexpr,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """out[row, head] from the splits' partials: weights exp(lse_s - max), the sink in the sum."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    used = s < num_splits
    at = row * NUM_HEADS + head
    lse_s = tl.load(part_lse + s * stride_split_lse + at, mask=used, other=float("-inf"))
    top = tl.max(lse_s, 0)
    seen = top > float("-inf")
    if HAS_SINKS:
        sink = tl.load(sinks + head) * 1.4426950408889634
        top = tl.where(seen, tl.maximum(top, sink), top)
    top = tl.where(seen, top, 0.0)
    w = tl.exp2(lse_s - top)
    total = tl.sum(w, 0)
    if HAS_SINKS:
        total = tl.where(seen, total + tl.exp2(sink - top), total)
    part_ptrs = part_out + s[:, None] * stride_split_out + at * D + d[None, :]
    parts = tl.load(part_ptrs, mask=used[:, None], other=0.0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(seen, total, 1.0)
    tl.store(out + row * stride_ot + head * D + d, o.to(out.dtype.element_ty))
    tl.store(lse + at, tl.where(seen, (top + tl.log2(tl.where(seen, total, 1.0))) * 0.6931471805599453,
                                float("-inf")))  # fmt: skip


@triton.jit(do_not_specialize=["num_reqs", "stride_bt", "window"])
def _prefill_kernel(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    query_start,
    sinks,
    kv_scale,
    out,
    lse,
    qk_scale,
    window,
    num_reqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_bt,
    stride_slot,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BS: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    FP8: tl.constexpr,
):
    target = tl.num_programs(0) - 1 - tl.program_id(0)  # last query blocks (most causal work) first
    kvh = tl.program_id(1) // NUM_CHUNKS
    chunk = tl.program_id(1) % NUM_CHUNKS
    first_row = tl.load(query_start)
    # The request whose blocks hold `target`: the last b with start(b) <= target.
    lo: tl.int32 = 0  # a tensor from the start: the loop reassigns it
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if (tl.load(query_start + mid) - first_row) // BLOCK_Q + mid <= target:
            lo = mid + 1
        else:
            hi = mid
    b = lo - 1
    q_start = tl.load(query_start + b)
    q_len = tl.load(query_start + b + 1) - q_start
    q_block = target - ((q_start - first_row) // BLOCK_Q + b)
    if q_block * BLOCK_Q >= q_len:  # a spare program of the grid's upper bound
        return
    seq_len = tl.load(seq_lens + b)

    m = tl.arange(0, BLOCK_M)
    qi = q_block * BLOCK_Q + m // HEADS
    g = chunk * HEADS + m % HEADS
    row_live = (qi < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    row = (q_start + qi).to(tl.int64)
    pos = seq_len - q_len + qi
    d = tl.arange(0, D)
    q_ptrs = q + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q_tile = tl.load(q_ptrs, mask=row_live[:, None], other=0.0)

    # Tiles [tile_lo, tile_hi) hold every key a row of this block sees; [full_lo, full_hi) of them
    # are visible to all rows (no mask), the others lie on the window's or the diagonal's edge.
    first_pos = seq_len - q_len + q_block * BLOCK_Q
    last_pos = tl.minimum(first_pos + BLOCK_Q - 1, seq_len - 1)
    kv_hi = seq_len
    full_hi = seq_len // BLOCK_N
    if CAUSAL:
        kv_hi = last_pos + 1
        full_hi = (first_pos + 1) // BLOCK_N
    tile_hi = tl.cdiv(kv_hi, BLOCK_N)
    tile_lo = 0
    full_lo = 0
    if HAS_WINDOW:
        tile_lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N
        full_lo = tl.minimum(tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N), tile_hi)
    full_hi = tl.maximum(tl.minimum(full_hi, tile_hi), full_lo)

    if FP8:  # keys are stored divided by their scale (kv_scale[0])
        qk_scale = qk_scale * tl.load(kv_scale)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    k_head, v_head, table_row = k_cache + kvh * D, v_cache + kvh * D, block_table + b * stride_bt
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q_tile, k_head, v_head, table_row, tile_lo, full_lo, kv_hi, pos, qk_scale, window,
        stride_slot, True, CAUSAL, HAS_WINDOW, BLOCK_N, BS, D,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q_tile, k_head, v_head, table_row, full_lo, full_hi, kv_hi, pos, qk_scale, window,
        stride_slot, False, CAUSAL, HAS_WINDOW, BLOCK_N, BS, D,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q_tile, k_head, v_head, table_row, full_hi, tile_hi, kv_hi, pos, qk_scale, window,
        stride_slot, True, CAUSAL, HAS_WINDOW, BLOCK_N, BS, D,
    )  # fmt: skip
    out_ptrs = out + row[:, None] * stride_ot + head[:, None] * D + d[None, :]
    _store_rows(acc, l_i, m_i, out_ptrs, lse + row * NUM_HEADS + head, row_live, head, sinks, kv_scale,
                HAS_SINKS, FP8)  # fmt: skip


_launch_decode = DirectLauncher(_decode_kernel)
_launch_merge = DirectLauncher(_merge_kernel)
_launch_prefill = DirectLauncher(_prefill_kernel)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def decode_splits(num_reqs: int, kv_programs: int, max_seq_len: int, device: torch.device) -> int:
    """Splits of each request's keys: from shapes known when a graph is recorded (batch size,
    programs per request, SM count, max_seq_len as an upper bound), never from device values."""
    programs = max(num_reqs * kv_programs, 1)
    wanted = triton.cdiv(PROGRAMS_PER_SM * _multiprocessors(device), programs)
    return max(1, min(wanted, triton.cdiv(max_seq_len, MIN_SPLIT_KEYS), MAX_SPLITS))


def _head_chunk(group: int, rows_per_head: int, max_rows: int) -> tuple[int, int]:
    """(heads a program packs, a power of two; chunks per KV head) for tiles of <= max_rows rows."""
    heads = min(triton.next_power_of_2(group), max(max_rows // rows_per_head, 1))
    return heads, triton.cdiv(group, heads)


def _prefill_tiles(head_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill kernel for a head size."""
    if head_size <= 64:
        return 128, 64, 4, 3
    if head_size <= 128:
        return 128, 64, 8, 3
    return 64, 32, 8, 2


def _check_inputs(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    sinks: torch.Tensor | None,
) -> None:
    check_cache(kv_cache)
    num_kv_heads, head_size = kv_cache.shape[3:]
    require(
        query.dim() == 3 and query.shape[2] == head_size and query.shape[1] % num_kv_heads == 0,
        lambda: f"query must be [T, H, {head_size}] with H a multiple of {num_kv_heads} KV heads, "
        f"got {tuple(query.shape)}",
    )
    require(query.dtype in QUERY_DTYPES, lambda: f"query dtype {query.dtype} must be bfloat16 or float16")
    require(
        kv_cache.dtype in (query.dtype, FP8),
        lambda: f"kv_cache dtype {kv_cache.dtype} with {query.dtype} queries: the kernels read a 16-bit "
        "cache in the query's format (or fp8)",
    )
    require(query.stride(2) == 1, lambda: f"query rows must be contiguous, got strides {query.stride()}")
    check_device("query", query, kv_cache.device)
    num_reqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    for name, t, shape in (
        ("seq_lens", seq_lens, (num_reqs,)),
        ("query_start_loc", query_start_loc, (num_reqs + 1,)),
        ("block_table", block_table, (num_reqs, block_table.shape[-1])),
    ):
        require(
            t.dtype == torch.int32 and tuple(t.shape) == shape,
            lambda name=name, t=t, shape=shape: f"{name} must be int32 {list(shape)}, got {t.dtype} "
            f"{list(t.shape)}",
        )
        require(t.stride(-1) == 1, lambda name=name: f"{name} must be contiguous in its last dimension")
        check_device(name, t, kv_cache.device)
    if sinks is not None:
        require(
            sinks.dtype == torch.float32 and tuple(sinks.shape) == (query.shape[1],),
            lambda: f"sinks must be float32 [{query.shape[1]}], got {sinks.dtype} {tuple(sinks.shape)}",
        )
        check_device("sinks", sinks, kv_cache.device)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    decode_reqs: int,
    decode_rows: int,
    decode_query_len: int,
    max_seq_len: int,
    sm_scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    kv_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query [T, H, D] over the paged cache: (out [T, H, D] in query's dtype, lse [T, H]).

    The first `decode_reqs` requests (rows [0, decode_rows), query lengths <= decode_query_len <= 8)
    take the split-KV decode kernel, the rest the prefill kernel. max_seq_len bounds seq_lens from
    above (it only sizes the split count); nothing here reads a device value, so a decode step
    (decode_reqs = all) can be recorded in a CUDA graph. `num_splits` overrides the split count.
    """
    _check_inputs(query, kv_cache, block_table, seq_lens, query_start_loc, sinks)
    scale = check_scale(kv_cache, kv_scale)
    require(
        0 <= decode_query_len <= MAX_DECODE_QUERY_LEN,
        lambda: f"decode_query_len {decode_query_len} must be in [0, {MAX_DECODE_QUERY_LEN}]",
    )
    require(
        sliding_window is None or sliding_window > 0, lambda: f"sliding_window {sliding_window} must be > 0"
    )
    tokens, num_heads, head_size = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_reqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    lse = torch.empty(tokens, num_heads, dtype=torch.float32, device=query.device)
    if tokens == 0:
        return out, lse
    fp8 = kv_cache.dtype == FP8
    qk_scale = sm_scale * LOG2E  # fp8: the kernels also multiply by the key scale
    common = dict(
        q=query, k_cache=kv_cache[0], v_cache=kv_cache[1], sinks=query if sinks is None else sinks,
        kv_scale=scale, out=out, lse=lse, window=sliding_window or 0, stride_qt=query.stride(0),
        stride_qh=query.stride(1), stride_ot=out.stride(0), stride_slot=num_kv_heads * head_size,
    )  # fmt: skip
    flags = dict(
        NUM_HEADS=num_heads, GROUP=group, D=head_size, BS=block_size, CAUSAL=causal,
        HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None, FP8=fp8,
    )  # fmt: skip
    if decode_reqs and decode_rows:
        _decode(query, common, flags, block_table[:decode_reqs], seq_lens[:decode_reqs],
                query_start_loc[: decode_reqs + 1], decode_rows, decode_query_len, max_seq_len, qk_scale,
                num_splits)  # fmt: skip
    if decode_reqs < num_reqs:
        block_m, block_n, num_warps, num_stages = _prefill_tiles(head_size)
        heads, chunks = _head_chunk(group, 1, block_m)
        block_q = block_m // heads
        prefill_reqs = num_reqs - decode_reqs
        grid = ((tokens - decode_rows) // block_q + prefill_reqs, num_kv_heads * chunks)
        _launch_prefill(
            grid, block_table=block_table[decode_reqs:], seq_lens=seq_lens[decode_reqs:],
            query_start=query_start_loc[decode_reqs:], qk_scale=qk_scale, num_reqs=prefill_reqs,
            stride_bt=block_table.stride(0), HEADS=heads, NUM_CHUNKS=chunks, BLOCK_M=block_m, BLOCK_Q=block_q,
            BLOCK_N=block_n, **common, **flags, num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return out, lse


def _decode(
    query: torch.Tensor,
    common: dict,
    flags: dict,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    rows: int,
    query_len: int,
    max_seq_len: int,
    qk_scale: float,
    num_splits: int | None,
) -> None:
    """The decode kernel over requests [0, len(seq_lens)) and rows [0, rows); the merge if split."""
    num_reqs, num_heads, head_size = seq_lens.shape[0], query.shape[1], query.shape[2]
    num_kv_heads = num_heads // flags["GROUP"]
    rows_per_head = triton.next_power_of_2(max(query_len, 1))
    heads, chunks = _head_chunk(flags["GROUP"], rows_per_head, DECODE_MAX_TILE_ROWS)
    block_m = max(16, rows_per_head * heads)  # tl.dot needs 16 rows
    block_n = 64 if head_size <= 128 else 32
    splits = num_splits or decode_splits(num_reqs, num_kv_heads * chunks, max_seq_len, query.device)
    if splits > 1:
        part_out = torch.empty(splits, rows, num_heads, head_size, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(splits, rows, num_heads, dtype=torch.float32, device=query.device)
    else:  # unused: the decode kernel writes the output itself
        part_out = part_lse = common["lse"]
    _launch_decode(
        (num_reqs, num_kv_heads * chunks, splits), block_table=block_table, seq_lens=seq_lens,
        query_start=query_start_loc, part_out=part_out, part_lse=part_lse, qk_scale=qk_scale,
        num_splits=splits, stride_bt=block_table.stride(0), stride_split_out=rows * num_heads * head_size,
        stride_split_lse=rows * num_heads, HEADS=heads, NUM_CHUNKS=chunks, BLOCK_M=block_m, BLOCK_N=block_n,
        SPLIT=splits > 1, **common, **flags, num_warps=4, num_stages=3,
    )  # fmt: skip
    if splits > 1:
        _launch_merge(
            (rows, num_heads), part_out, part_lse, common["sinks"], common["out"], common["lse"], splits,
            rows * num_heads * head_size, rows * num_heads, common["out"].stride(0), NUM_HEADS=num_heads,
            D=head_size, SPLITS=triton.next_power_of_2(splits), HAS_SINKS=flags["HAS_SINKS"], num_warps=4,
        )  # fmt: skip

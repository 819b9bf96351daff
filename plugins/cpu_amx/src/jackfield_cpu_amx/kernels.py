"""Absorbed MLA over the paged latent cache, one request group at a time, in plain PyTorch ops.

Per group: gather the group's cache blocks into a reused buffer (one parallel memcpy per block),
then attend with one of two kernels, both oneDNN bfloat16 or float32 products with a float32
softmax:
- fused, for up to plan.FUSED_MAX_ROWS query rows per request (decode of up to 32 heads): one call
  of PyTorch's CPU flash-attention kernel, whose tasks are (request, key chunk) pairs, each reading
  its key tile once for both products; the chunks' partial outputs merge through their LSEs
  (split-K), so short batches still fill every core.
- bmm, for more rows in float32: the flash kernel re-reads each key tile per 32-row query slice,
  while two batched products take all of a request's rows per key tile. Not for bfloat16: its
  scores leave the first product rounded to bfloat16 (errors of 0.1-0.2 in the output once the
  logits reach ~10-30, where the fused kernel stays within 0.01), so 16-bit groups always run fused.
Measured on the 16-core AMX host (B=16, S=4096, H=16, bf16, one group, one chunk per request):
the gather reads 75 MB in 0.6 ms; the fused kernel takes 1.4 ms, ~105 GFLOP/s per core. Its
bfloat16 products are MKL bf16 x bf16 -> float32 GEMMs, mostly spent packing each transposed key
tile (32 query rows cost about what 16 do); torch 2.11 packs keys for AMX brgemm in this kernel
for float16 only (PERF_NOTES.md). At H=128 the bmm kernel (10 ms in slices of 4 requests) beat
the fused kernel (23-25 ms) in bfloat16, which is the speed its precision cost.
"""

from __future__ import annotations

import torch

from jackfield_cpu_amx.plan import DecodeRows, KeyChunks, RequestGroup, Scratch

# index_select memcpys rows shorter than this many elements in parallel over the indices, and
# copies longer rows one at a time through a parallel element-wise copy (ATen's GRAIN_SIZE).
# That per-row path ran the gather at 12-18 GB/s on the 16-core AMX host (copy: 73-94 GB/s).
_PARALLEL_MEMCPY_ELEMENTS = 32768
_INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _copy_rows(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The cache as bit-exact integer rows short enough for the parallel memcpy path, and how
    many rows each block spans."""
    num_blocks, block_size, width = kv_cache.shape
    token_bytes = width * kv_cache.element_size()
    int_size = next(size for size in _INT_OF_SIZE if token_bytes % size == 0)
    parts = next(
        p
        for p in range(1, block_size + 1)
        if block_size % p == 0
        and block_size // p * token_bytes // int_size < _PARALLEL_MEMCPY_ELEMENTS
        or p == block_size
    )
    return kv_cache.view(num_blocks * parts, -1).view(_INT_OF_SIZE[int_size]), parts


def _gather_blocks(
    blocks: torch.Tensor, chunks: KeyChunks, halves: int, compute_dtype: torch.dtype, scratch: Scratch
) -> torch.Tensor:
    """blocks [halves * num_blocks, block_size, width] gathered as `chunks` says, [halves *
    len(block_ids) * block_size, width] in `compute_dtype`, by one index op, the stale records zeroed."""
    width = blocks.shape[-1]
    rows, parts = _copy_rows(blocks)
    row_ids, stale = chunks.gather_index(blocks.shape[0] // halves, blocks.shape[1], parts, halves)
    as_rows = scratch.get(rows.dtype, row_ids.numel() * rows.shape[1]).view(-1, rows.shape[1])
    torch.index_select(rows, 0, row_ids, out=as_rows)
    gathered = as_rows.view(blocks.dtype).view(-1, width)
    if stale.numel():
        gathered.index_fill_(0, stale, 0)
    if blocks.dtype != compute_dtype:
        gathered = scratch.get(compute_dtype, gathered.numel()).view_as(gathered).copy_(gathered)
    return gathered


def gather_group_cache(
    kv_cache: torch.Tensor,
    group: RequestGroup,
    chunks: KeyChunks,
    compute_dtype: torch.dtype,
    scratch: Scratch,
) -> torch.Tensor:
    """The group's cache records laid out as `chunks` says: [num_reqs, blocks_per_req * block_size, L+R]."""
    gathered = _gather_blocks(kv_cache, chunks, 1, compute_dtype, scratch)
    return gathered.view(group.num_reqs, -1, kv_cache.shape[-1])


def gather_group_kv(
    kv_cache: torch.Tensor,
    group: RequestGroup,
    chunks: KeyChunks,
    compute_dtype: torch.dtype,
    scratch: Scratch,
) -> torch.Tensor:
    """An MHA cache's [2, num_blocks, block_size, H_kv, D] blocks of the group, keys and values in
    one index op, laid out as `chunks` says: [2, num_reqs, blocks_per_req * block_size, H_kv, D]."""
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    blocks = kv_cache.view(2 * num_blocks, block_size, num_kv_heads * head_size)  # keys', then values'
    gathered = _gather_blocks(blocks, chunks, 2, compute_dtype, scratch)
    return gathered.view(2, group.num_reqs, -1, num_kv_heads, head_size)


def gather_decode_kv(
    kv_cache: torch.Tensor, rows: DecodeRows, compute_dtype: torch.dtype, scratch: Scratch
) -> torch.Tensor:
    """An MHA cache's records of `rows` (keys and values in one index op), in `compute_dtype`:
    [2, num_reqs, rows.num_keys, H_kv, D]."""
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    width = num_kv_heads * head_size
    records = kv_cache.view(2 * num_blocks * block_size, width)
    gathered = scratch.get(kv_cache.dtype, rows.row_ids.numel() * width).view(-1, width)
    torch.index_select(records, 0, rows.row_ids, out=gathered)
    if kv_cache.dtype != compute_dtype:
        gathered = scratch.get(compute_dtype, gathered.numel()).view_as(gathered).copy_(gathered)
    return gathered.view(2, -1, rows.num_keys, num_kv_heads, head_size)


def attend_decode_mha(
    query: torch.Tensor, kv: torch.Tensor, rows: DecodeRows, scale: float, with_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """query [g, H, D] (one token a request, in kv's dtype) over kv [2, g, keys, H_kv, D]
    (gather_decode_kv): out [g, H, D] and, `with_lse`, lse [g, H] float32 (else None).

    One call of PyTorch's CPU flash kernel with the query heads that share a KV head as rows of
    one kernel head: each (request, KV head) task reads its keys once for all of them. Its output
    is contiguous [g, H_kv, fold, D], so `out` is a view of it (no copy).
    """
    g, num_heads, head_size = query.shape
    num_kv_heads = kv.shape[3]
    fold = num_heads // num_kv_heads  # query head h reads KV head h // fold
    keys, values = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [g, H_kv, keys, D]
    part_out, part_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query.view(g, num_kv_heads, fold, head_size), keys, values, 0.0, False, attn_mask=rows.mask,
        scale=scale,
    )
    return part_out.reshape(g, num_heads, head_size), part_lse.reshape(g, num_heads) if with_lse else None


def attend_group_fused(
    query: torch.Tensor,
    keys: torch.Tensor,
    group: RequestGroup,
    chunks: KeyChunks,
    kv_lora_rank: int,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """query [g * q_len, H, L+R] (in keys' dtype) over keys [g, chunked keys, L+R] (as gathered
    for `chunks`); writes out [g * q_len, H, L] and lse [g * q_len, H].

    Heads and query rows of a request fold into rows = q_len * H queries against its keys.
    """
    g, q_len, n = group.num_reqs, group.q_len, chunks.num_chunks
    num_heads, width = query.shape[1], keys.shape[-1]
    rows = q_len * num_heads
    # Chunks take the place of attention heads; the queries are a stride-0 view over them. The
    # values are the whole records (the kernel wants equal head sizes): rope columns are dropped after.
    q = query.view(g, 1, rows, width).expand(g, n, rows, width)
    k = keys.view(g, n, -1, width)
    mask = chunks.mask
    if mask is not None:  # [g, n, q_len, keys] -> [g, n, q_len * H, keys]: a view when q_len is 1
        mask = mask.unsqueeze(3).expand(-1, -1, -1, num_heads, -1).reshape(g, n, rows, -1)
    part_out, part_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, k, 0.0, False, attn_mask=mask, scale=scale
    )
    part_out = part_out[..., :kv_lora_rank]  # [g, n, rows, L]
    if chunks.chunk_bias is not None:  # the kernel reports LSE 0, not -inf, for a row blind to its chunk
        part_lse = (part_lse.view(g, n, q_len, num_heads) + chunks.chunk_bias).view(g, n, rows)
    if n == 1:
        out.view(g, rows, kv_lora_rank).copy_(part_out[:, 0])
        lse.view(g, rows).copy_(part_lse[:, 0])
        return
    # Split-K merge: each chunk's output weighted by its share of the row's softmax mass.
    torch.logsumexp(part_lse, dim=1, out=lse.view(g, rows))
    weights = torch.softmax(part_lse, dim=1)  # [g, n, rows]
    out.view(g, rows, kv_lora_rank).copy_(torch.einsum("gnr,gnrl->grl", weights, part_out.float()))


# The bmm kernel's float32 scores [requests, rows, keys] pass through ~6 element-wise ops; on the
# AMX host at H=128, slices of 4 requests x 4096 keys ran 1.8x faster than all 16 at once.
BMM_SLICE_KEYS = 16384


def attend_group_bmm(
    query: torch.Tensor,
    keys: torch.Tensor,
    group: RequestGroup,
    chunks: KeyChunks,
    kv_lora_rank: int,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """attend_group_fused's contract, for keys gathered one chunk per request; requests in slices
    of about BMM_SLICE_KEYS keys."""
    g, q_len, num_heads = group.num_reqs, group.q_len, query.shape[1]
    rows = q_len * num_heads
    per_slice = max(1, BMM_SLICE_KEYS // keys.shape[1])
    for r0 in range(0, g, per_slice):
        r1 = min(g, r0 + per_slice)
        n, t0, t1 = r1 - r0, r0 * q_len, r1 * q_len
        scores = torch.bmm(query[t0:t1].view(n, rows, -1), keys[r0:r1].transpose(1, 2))
        logits = scores.float().mul_(scale).view(n, q_len, num_heads, -1)
        if chunks.mask is not None:
            logits += chunks.mask[r0:r1].view(n, q_len, 1, -1)
        group_lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        probs = logits.sub_(group_lse).exp_().to(keys.dtype).view(n, rows, -1)
        # The product over whole contiguous records (rope columns included, then dropped) runs ~3x
        # faster in oneDNN than over the strided latent slice, for 12% more arithmetic.
        latent = torch.bmm(probs, keys[r0:r1])[:, :, :kv_lora_rank]
        out[t0:t1].view(n, rows, kv_lora_rank).copy_(latent)
        lse[t0:t1].view(n, rows).copy_(group_lse.view(n, rows))


def attend_group_mha(
    query: torch.Tensor,
    kv: torch.Tensor,
    group: RequestGroup,
    chunks: KeyChunks,
    scale: float,
    fold_heads: bool,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """query [g * q_len, H, D] (in kv's dtype) over kv [2, g, chunked keys, H_kv, D] (as gathered
    for `chunks`); writes out [g * q_len, H, D] and lse [g * q_len, H].

    One call of PyTorch's CPU flash kernel, whose batch is (request, key chunk) and whose heads
    are GQA heads: query head h reads KV head h // (H / H_kv) inside the kernel, K/V never
    repeated. `fold_heads` (short queries) makes the query heads sharing a KV head rows of one
    kernel head instead, so each task reads its key tile once for all of them.
    """
    g, q_len, n = group.num_reqs, group.q_len, chunks.num_chunks
    num_heads, head_size, num_kv_heads = query.shape[1], query.shape[2], kv.shape[3]
    fold = num_heads // num_kv_heads if fold_heads else 1
    kernel_heads, rows = num_heads // fold, q_len * fold
    # [g, q_len, heads, fold, D] -> [g, heads, q_len * fold, D]: a view when q_len or fold is 1.
    q = query.view(g, 1, q_len, kernel_heads, fold, head_size).permute(0, 1, 3, 2, 4, 5)
    q = q.expand(g, n, -1, -1, -1, -1).reshape(g * n, kernel_heads, rows, head_size)
    keys, values = (half.view(g * n, -1, num_kv_heads, head_size).transpose(1, 2) for half in kv)
    part_out, part_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, keys, values, 0.0, chunks.kernel_causal, attn_mask=chunks.row_mask(fold), scale=scale
    )
    # Back to the token-major layout of the outputs: [g, n, q_len, heads, fold, (D)].
    part_out = part_out.view(g, n, kernel_heads, q_len, fold, head_size).permute(0, 1, 3, 2, 4, 5)
    part_lse = part_lse.view(g, n, kernel_heads, q_len, fold).permute(0, 1, 3, 2, 4)
    if chunks.chunk_bias is not None:  # the kernel reports LSE 0, not -inf, for a row blind to its chunk
        part_lse = part_lse + chunks.chunk_bias.view(g, n, q_len, 1, 1)
    out_view = out.view(g, q_len, kernel_heads, fold, head_size)
    lse_view = lse.view(g, q_len, kernel_heads, fold)
    if n == 1:
        out_view.copy_(part_out[:, 0])
        lse_view.copy_(part_lse[:, 0])
        return
    # Split-K merge: each chunk's output weighted by its share of the row's softmax mass.
    torch.logsumexp(part_lse, dim=1, out=lse_view)
    weights = torch.softmax(part_lse, dim=1)  # [g, n, q_len, heads, fold]
    out_view.copy_(torch.einsum("gnqhf,gnqhfd->gqhfd", weights, part_out.float()))


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Sinks [H]: a per-head logit in each row's softmax denominator, with no value. In place on
    out [T, H, D] and lse [T, H]: out scaled by the keys' share exp(lse) / (exp(lse) + exp(sink));
    a row that saw no key keeps out 0 and lse -inf."""
    seen = torch.isfinite(lse)
    out.mul_(torch.sigmoid(lse - sinks).unsqueeze(-1).to(out.dtype))
    torch.where(seen, torch.logaddexp(lse, sinks), lse, out=lse)

"""Absorbed MLA over the paged latent cache, one request group at a time, in plain PyTorch ops.

The two matrix products are batched bmm calls that oneDNN runs on the AMX tile units for
bfloat16 (on AVX-512 for float32). Per group: gather the group's cache blocks into a reused
buffer (it stays in the CPU caches for both products), scores = q·Kᵀ, float32 softmax with the
plan's bias, out = p·V, LSE from the same float32 scores.
"""

from __future__ import annotations

import torch

from jackfield_cpu_amx.plan import KeyChunks, RequestGroup, Scratch

_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32}


def gather_group_cache(
    kv_cache: torch.Tensor,
    group: RequestGroup,
    compute_dtype: torch.dtype,
    scratch: Scratch,
    chunks: KeyChunks | None = None,
) -> torch.Tensor:
    """The group's cache records as [num_reqs, blocks * block_size, L+R] in `compute_dtype`
    (blocks laid out as `chunks` says when given)."""
    num_blocks, block_size, width = kv_cache.shape
    block_ids = group.block_ids(block_size) if chunks is None else chunks.block_ids
    rows = kv_cache.view(num_blocks, block_size * width)
    gathered = scratch.get(kv_cache.dtype, block_ids.numel() * rows.shape[1]).view(-1, rows.shape[1])
    # A bit-exact copy: index_select on bfloat16 takes a slow element-wise path (up to 300x slower
    # into a buffer slice, measured on torch 2.13); on same-width integers it is a row memcpy.
    as_int = _SAME_WIDTH_INT[kv_cache.element_size()]
    torch.index_select(rows.view(as_int), 0, block_ids, out=gathered.view(as_int))
    stale = group.stale_rows(block_size, None if chunks is None else chunks.blocks_per_req)
    if stale.numel():
        gathered.view(-1, width).view(as_int).index_fill_(0, stale, 0)
    if kv_cache.dtype != compute_dtype:
        converted = scratch.get(compute_dtype, gathered.numel()).view_as(gathered)
        gathered = converted.copy_(gathered)
    return gathered.view(group.num_reqs, -1, width)


def attend_group(
    query: torch.Tensor,
    keys: torch.Tensor,
    group: RequestGroup,
    kv_lora_rank: int,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """query [g * q_len, H, L+R] over keys [g, >= num_keys, L+R]; writes out [g * q_len, H, L], lse [g * q_len, H].

    Heads and query rows of a request fold into one M = q_len * H row block against its keys.
    """
    g, q_len, num_keys = group.num_reqs, group.q_len, group.num_keys
    num_heads = query.shape[1]
    keys = keys[:, :num_keys]
    q = query.to(keys.dtype).reshape(g, q_len * num_heads, -1)
    scores = torch.bmm(q, keys.transpose(1, 2)).view(g, q_len, num_heads, num_keys)
    logits = torch.add(group.key_bias, scores, alpha=scale)  # float32: bias is float32; keys are finite
    group_lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    probs = logits.sub_(group_lse).exp_().to(keys.dtype).view(g, q_len * num_heads, num_keys)
    # The product over whole contiguous records (rope columns included, then dropped) runs ~3x
    # faster in oneDNN than over the strided latent slice, for 12% more arithmetic.
    latent = torch.bmm(probs, keys)[:, :, :kv_lora_rank]
    out.copy_(latent.reshape(g * q_len, num_heads, kv_lora_rank))
    lse.copy_(group_lse.view(g * q_len, num_heads))


def attend_group_chunked(
    query: torch.Tensor,
    keys: torch.Tensor,
    group: RequestGroup,
    chunks: KeyChunks,
    kv_lora_rank: int,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Same contract as attend_group, over keys laid out by `chunks`: every (request, chunk) is one
    task of PyTorch's fused CPU flash-attention kernel, which reads each key tile once for both
    products; the chunks' partial results merge through their LSEs (split-K)."""
    g, q_len, n = group.num_reqs, group.q_len, chunks.num_chunks
    num_heads, width = query.shape[1], keys.shape[-1]
    rows = q_len * num_heads
    # Chunks take the place of attention heads: [g, n, rows, width] queries are a stride-0 view.
    q = query.to(keys.dtype).view(g, 1, rows, width).expand(g, n, rows, width)
    k = keys.view(g, n, -1, width)
    mask = chunks.mask.unsqueeze(3).expand(-1, -1, -1, num_heads, -1).reshape(g, n, rows, -1)
    part_out, part_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, k, 0.0, False, attn_mask=mask, scale=scale
    )
    part_out = part_out.view(g, n, rows, width)[..., :kv_lora_rank]
    # The kernel reports LSE 0 (not -inf) for a row with no visible key in its chunk.
    part_lse = part_lse.view(g, n, q_len, num_heads).add(chunks.chunk_bias).view(g, n, rows)
    group_lse = torch.logsumexp(part_lse, dim=1)  # [g, rows]
    if n == 1:
        merged = part_out[:, 0]
    else:
        weights = part_lse.sub_(group_lse[:, None]).exp_()  # [g, n, rows]
        merged = torch.einsum("gnr,gnrl->grl", weights, part_out.float())
    out.copy_(merged.reshape(g * q_len, num_heads, kv_lora_rank))
    lse.copy_(group_lse.view(g * q_len, num_heads))

"""Random paged MLA and MHA problems for cpu_amx's tests, and their float64 answer from the oracle
(jackfield.ops.reference)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jackfield.attention.kv_cache import cache_shape, is_mla
from jackfield.contracts.attention import AttentionLayerSpec, AttentionMetadata
from jackfield.ops.reference import paged_attention
from jackfield.testing.problems import query_width


@dataclass
class Problem:
    layer: AttentionLayerSpec
    query: torch.Tensor  # [T, H, L+R] (MLA), [T, H, D] (MHA)
    kv_cache: torch.Tensor  # [num_blocks, block_size, L+R] (MLA), [2, num_blocks, block_size, H_kv, D]
    metadata: AttentionMetadata


def make_problem(
    layer: AttentionLayerSpec,
    q_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    dtype: torch.dtype,
    *,
    num_decodes: int = 0,
    causal: bool = True,
    seed: int = 0,
) -> Problem:
    """Random queries and cache, shuffled non-contiguous block tables, padding columns set to -1.
    MHA caches hold NaN in every slot no request owns, so a read past a request's keys shows."""
    gen = torch.Generator().manual_seed(seed)
    width = query_width(layer)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req) + 1
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_req):
        table[b, :n] = perm[used : used + n].int()
        used += n
    kv_cache = torch.randn(cache_shape(layer, num_blocks, block_size), generator=gen).to(dtype)
    if not is_mla(layer):
        owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        for b, seq_len in enumerate(seq_lens):
            pos = torch.arange(seq_len)
            owned[table[b, pos // block_size].long() * block_size + pos % block_size] = True
        kv_cache.flatten(1, 2)[:, ~owned] = float("nan")
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, layer.num_heads, width, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=seq,
        block_table=table,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
        query_start_loc_cpu=qsl.clone(),
        seq_lens_cpu=seq.clone(),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        num_decodes=num_decodes,
        num_decode_tokens=sum(q_lens[:num_decodes]),
        causal=causal,
    )
    return Problem(layer, query, kv_cache, metadata)


def reference_attend(p: Problem, sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (out [T, H, Dv], lse [T, H]) with the layer's sliding window. MLA is absorbed: keys
    are the whole latent records, values their first kv_lora_rank entries."""
    md = p.metadata
    if not is_mla(p.layer):
        return paged_attention(
            p.query.double(),
            p.kv_cache[0],
            p.kv_cache[1],
            md.block_table,
            md.seq_lens_cpu,
            md.query_start_loc_cpu,
            p.layer.scale,
            causal=md.causal,
            sliding_window=p.layer.sliding_window,
            sinks=sinks,
        )
    return paged_attention(
        p.query.double(),
        p.kv_cache[:, :, None],
        p.kv_cache[:, :, None, : p.layer.kv_lora_rank],
        md.block_table,
        md.seq_lens_cpu,
        md.query_start_loc_cpu,
        p.layer.scale,
        causal=md.causal,
        sliding_window=p.layer.sliding_window,
        sinks=sinks,
    )

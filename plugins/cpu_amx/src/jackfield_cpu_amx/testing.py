"""Random paged MLA problems for cpu_amx's tests, and their float64 answer from the oracle
(jackfield.ops.reference)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jackfield.contracts.attention import AttentionLayerSpec, AttentionMetadata
from jackfield.ops.reference import paged_attention


@dataclass
class Problem:
    layer: AttentionLayerSpec
    query: torch.Tensor  # [T, H, L+R]
    kv_cache: torch.Tensor  # [num_blocks, block_size, L+R]
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
    """Random queries and cache, shuffled non-contiguous block tables, padding columns set to -1."""
    gen = torch.Generator().manual_seed(seed)
    width = layer.kv_lora_rank + layer.qk_rope_head_dim
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req) + 1
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_req):
        table[b, :n] = perm[used : used + n].int()
        used += n
    kv_cache = torch.randn(num_blocks, block_size, width, generator=gen).to(dtype)
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


def reference_attend(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 absorbed MLA (out [T, H, L], lse [T, H]): keys are the whole latent records, values
    their first kv_lora_rank entries."""
    md = p.metadata
    return paged_attention(
        p.query.double(),
        p.kv_cache[:, :, None],
        p.kv_cache[:, :, None, : p.layer.kv_lora_rank],
        md.block_table,
        md.seq_lens_cpu,
        md.query_start_loc_cpu,
        p.layer.scale,
        causal=md.causal,
    )

"""Random paged MLA problems and an independent float64 reference (written from the MLA formula)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jackfield.contracts.attention import AttentionLayerSpec, AttentionMetadata


@dataclass
class Problem:
    layer: AttentionLayerSpec
    query: torch.Tensor  # [T, H, L+R]
    kv_cache: torch.Tensor  # [num_blocks, block_size, L+R]
    metadata: AttentionMetadata


def make_layer(
    num_heads: int, kv_lora_rank: int = 64, rope: int = 16, nope: int = 32, v: int = 32
) -> AttentionLayerSpec:
    return AttentionLayerSpec(
        num_heads=num_heads,
        head_size=kv_lora_rank + rope,
        scale=(nope + rope) ** -0.5,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
    )


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
    """float64 absorbed MLA: keys are the whole records, values their first kv_lora_rank entries."""
    md, lay = p.metadata, p.layer
    block_size = p.kv_cache.shape[1]
    outs, lses = [], []
    qsl = md.query_start_loc_cpu.tolist()
    for b, seq_len in enumerate(md.seq_lens_cpu.tolist()):
        q = p.query[qsl[b] : qsl[b + 1]].double()
        q_len = q.shape[0]
        pos = torch.arange(seq_len)
        records = p.kv_cache[md.block_table[b, pos // block_size].long(), pos % block_size].double()
        scores = torch.einsum("qhd,kd->qhk", q, records) * lay.scale
        if md.causal:
            q_pos = torch.arange(seq_len - q_len, seq_len)
            scores = scores.masked_fill((pos[None, :] > q_pos[:, None])[:, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(
            torch.einsum("qhk,kl->qhl", torch.exp(scores - lse[..., None]), records[:, : lay.kv_lora_rank])
        )
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)

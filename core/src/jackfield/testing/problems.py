"""Random paged-attention problems: ragged requests, shuffled block tables, poisoned spare slots.

Every slot no request owns (spare blocks, the tail of each request's last block, block-table
padding) holds NaN, so a kernel that reads outside what the metadata describes produces NaN.
Also the float64 answer of MLA's expanded prefill (`expanded_mla_reference`), by the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jackfield.attention.kv_cache import FP8_DTYPE, allocate_kv_cache, is_mla
from jackfield.contracts.attention import AttentionLayerSpec, AttentionMetadata, KVCacheDType
from jackfield.ops.reference import varlen_attention


def mla_layer(
    num_heads: int = 4,
    kv_lora_rank: int = 64,
    qk_rope_head_dim: int = 16,
    qk_nope_head_dim: int = 32,
    v_head_dim: int = 32,
    kv_cache_dtype: KVCacheDType = "auto",
    sliding_window: int | None = None,
) -> AttentionLayerSpec:
    return AttentionLayerSpec(
        num_heads=num_heads,
        head_size=kv_lora_rank + qk_rope_head_dim,
        scale=(qk_nope_head_dim + qk_rope_head_dim) ** -0.5,
        kv_cache_dtype=kv_cache_dtype,
        sliding_window=sliding_window,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim,
    )


def mha_layer(
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 32,
    kv_cache_dtype: KVCacheDType = "auto",
    sliding_window: int | None = None,
) -> AttentionLayerSpec:
    return AttentionLayerSpec(
        num_heads=num_heads,
        head_size=head_size,
        scale=head_size**-0.5,
        num_kv_heads=num_kv_heads,
        kv_cache_dtype=kv_cache_dtype,
        sliding_window=sliding_window,
    )


@dataclass
class PagedBatch:
    """One step's metadata plus where every request's tokens live."""

    metadata: AttentionMetadata
    num_blocks: int
    block_size: int
    context_slots: torch.Tensor  # [C] int64: slots of tokens written before this step
    num_tokens: int  # new tokens this step (rows of query / slot_mapping)


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_decodes: int,
    block_size: int,
    device: torch.device | str,
    generator: torch.Generator,
    *,
    causal: bool = True,
    spare_blocks: int = 2,
) -> PagedBatch:
    """Requests with `seq_lens[b]` tokens, the last `q_lens[b]` new; physical blocks shuffled."""
    if len(q_lens) != len(seq_lens) or any(not 0 <= q <= s for q, s in zip(q_lens, seq_lens, strict=True)):
        raise ValueError(f"need 0 <= q_len <= seq_len per request, got {q_lens} / {seq_lens}")
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + spare_blocks
    order = torch.randperm(num_blocks, generator=generator).tolist()
    spare = order[-1]  # block-table padding points at a poisoned block, not at a real one
    width = max(blocks_per_req) + 1
    table = torch.full((len(seq_lens), width), spare, dtype=torch.int32)
    new_slots: list[int] = []
    context_slots: list[int] = []
    taken = 0
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        table[b, : blocks_per_req[b]] = torch.tensor(
            order[taken : taken + blocks_per_req[b]], dtype=torch.int32
        )
        taken += blocks_per_req[b]
        for pos in range(seq_len):
            slot = int(table[b, pos // block_size]) * block_size + pos % block_size
            (new_slots if pos >= seq_len - q_len else context_slots).append(slot)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        query_start_loc=qsl.to(device),
        seq_lens=seq.to(device),
        block_table=table.to(device),
        slot_mapping=torch.tensor(new_slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        num_decodes=num_decodes,
        num_decode_tokens=int(qsl[num_decodes]),
        causal=causal,
    )
    return PagedBatch(
        metadata,
        num_blocks,
        block_size,
        torch.tensor(context_slots, dtype=torch.int64, device=device),
        len(new_slots),
    )


def poisoned_cache(
    layer: AttentionLayerSpec, batch: PagedBatch, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A cache for `batch` filled with NaN (fp8: the e4m3fn NaN byte 0x7F)."""
    cache = allocate_kv_cache(layer, batch.num_blocks, batch.block_size, dtype, device)
    if cache.dtype == FP8_DTYPE:
        cache.view(torch.uint8).fill_(0x7F)
    else:
        cache.fill_(float("nan"))
    return cache


def random_kv(
    layer: AttentionLayerSpec,
    num_tokens: int,
    dtype: torch.dtype,
    device: torch.device | str,
    g: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What write_kv takes for `num_tokens` tokens: MLA (kv_c, k_pe), MHA (key, value)."""
    if is_mla(layer):
        shapes = [(num_tokens, layer.kv_lora_rank), (num_tokens, layer.qk_rope_head_dim)]
    else:
        shapes = [(num_tokens, layer.num_kv_heads, layer.head_size)] * 2
    key, value = (torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes)
    return key, value


def query_width(layer: AttentionLayerSpec) -> int:
    """The last dim of `attend`'s query: MLA latent (L + R), MHA head size."""
    return layer.kv_lora_rank + layer.qk_rope_head_dim if is_mla(layer) else layer.head_size


def sparse_topk(batch: PagedBatch, k: int, g: torch.Generator) -> torch.Tensor:
    """[T, k] int32 random causally-visible request-local positions, -1 padded. The last request's
    first row selects nothing (its output must be 0 and its LSE -inf)."""
    md = batch.metadata
    rows: list[list[int]] = []
    qsl = md.query_start_loc_cpu.tolist()
    for b, seq_len in enumerate(md.seq_lens_cpu.tolist()):
        q_len = qsl[b + 1] - qsl[b]
        for i in range(q_len):
            visible = seq_len - q_len + i + 1
            take = (
                0
                if (b == md.num_reqs - 1 and i == 0)
                else int(torch.randint(1, min(k, visible) + 1, (), generator=g))
            )
            chosen = torch.randperm(visible, generator=g)[:take].tolist()
            rows.append(chosen + [-1] * (k - take))
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, k).to(md.slot_mapping.device)


def expanded_mla_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    kv_b_proj: torch.Tensor,
    layer: AttentionLayerSpec,
    *,
    rounded_to: torch.dtype | None = None,
) -> torch.Tensor:
    """float64 [T, H, v_head_dim]: MLA prefill in its expanded form, by the oracle. Per request, the
    cached latents through kv_b_proj give k_nope and v (first rounded to `rounded_to`, as a model's
    expansion matmul in that dtype rounds them); k = k_nope ‖ k_pe; query [T, H, nope + rope]."""
    heads, latent, nope = layer.num_heads, layer.kv_lora_rank, layer.qk_nope_head_dim
    w = kv_b_proj.double().view(heads, nope + layer.v_head_dim, latent)
    block_size = kv_cache.shape[1]
    keys, values = [], []
    for b, seq_len in enumerate(metadata.seq_lens_cpu.tolist()):
        pos = torch.arange(seq_len)
        records = kv_cache[metadata.block_table[b, pos // block_size].long(), pos % block_size].double()
        k_nope = torch.einsum("sl,hnl->shn", records[:, :latent], w[:, :nope])
        v = torch.einsum("sl,hvl->shv", records[:, :latent], w[:, nope:])
        if rounded_to is not None:
            k_nope, v = k_nope.to(rounded_to).double(), v.to(rounded_to).double()
        keys.append(torch.cat([k_nope, records[:, None, latent:].expand(-1, heads, -1)], dim=-1))
        values.append(v)
    cu_seqlens_k = [0, *torch.tensor(metadata.seq_lens_cpu.tolist()).cumsum(0).tolist()]
    out, _ = varlen_attention(
        query.double(),
        torch.cat(keys),
        torch.cat(values),
        metadata.query_start_loc_cpu.tolist(),
        cu_seqlens_k,
        layer.scale,
        causal=metadata.causal,
    )
    return out

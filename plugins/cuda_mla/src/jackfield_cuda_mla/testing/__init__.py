"""Helpers shared by cuda_mla's tests: the float64 oracle of an `mla_decode` call (here) and the
sm_90 compile of the Gluon kernels with a reading of their SASS (`sm90`)."""

from __future__ import annotations

import torch
from jackfield.ops.reference import paged_attention


def decode_reference(
    batch: dict[str, object],
    sm_scale: float,
    kv_lora_rank: int,
    *,
    causal: bool = True,
    topk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (out [T, H, kv_lora_rank], lse [T, H]) on the CPU for the query, kv_cache, block_table,
    seq_lens, query_start_loc and kv_scale (None: a 16-bit cache) an `mla_decode` call takes."""
    cpu = {name: value.cpu() for name, value in batch.items() if isinstance(value, torch.Tensor)}
    cache = cpu["kv_cache"]
    return paged_attention(
        cpu["query"].double(),
        cache[:, :, None],  # the latent record is the key of its one kv head ...
        cache[:, :, None, :kv_lora_rank],  # ... and its first kv_lora_rank entries the value
        cpu["block_table"],
        cpu["seq_lens"],
        cpu["query_start_loc"],
        sm_scale,
        causal=causal,
        kv_scale=cpu.get("kv_scale"),
        topk_indices=None if topk_indices is None else topk_indices.cpu(),
    )

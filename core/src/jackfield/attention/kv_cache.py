"""Paged KV-cache layouts, allocation, and the plain-PyTorch read/write paths.

MLA cache [num_blocks, block_size, kv_lora_rank + rope_dim] (latent ‖ rope key, one record per token).
MHA cache [2, num_blocks, block_size, H_kv, D] (key, value).
fp8 caches hold float8_e4m3fn values clamp(x / scale, -448, 448) with per-tensor float32 scales,
`kv_scale`: [1] for an MLA cache (its one record per token), [2] for an MHA cache (key scale,
value scale). Element 0 scales keys, element -1 values, so one indexing serves both layouts.
"""

from __future__ import annotations

import torch

from jackfield.contracts.attention import AttentionLayerSpec, KVCacheDType

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_mla(layer: AttentionLayerSpec) -> bool:
    return layer.kv_lora_rank > 0


def cache_dtype(kv_cache_dtype: KVCacheDType, activation_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a cache holds for a configured kv_cache_dtype."""
    if kv_cache_dtype == "auto":
        return activation_dtype
    if kv_cache_dtype == "bfloat16":
        return torch.bfloat16
    if kv_cache_dtype == "fp8_e4m3":
        return FP8_DTYPE
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; expected auto, bfloat16 or fp8_e4m3")


def cache_shape(layer: AttentionLayerSpec, num_blocks: int, block_size: int) -> tuple[int, ...]:
    if is_mla(layer):
        width = layer.kv_lora_rank + layer.qk_rope_head_dim
        if layer.head_size != width:
            raise ValueError(f"MLA head_size {layer.head_size} != kv_lora_rank + rope dim = {width}")
        return (num_blocks, block_size, width)
    return (2, num_blocks, block_size, layer.num_kv_heads, layer.head_size)


def allocate_kv_cache(
    layer: AttentionLayerSpec,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """A zeroed cache for `layer`; `dtype` is the activation dtype (used when kv_cache_dtype is auto)."""
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
    shape = cache_shape(layer, num_blocks, block_size)
    return torch.zeros(shape, dtype=cache_dtype(layer.kv_cache_dtype, dtype), device=device)


def kv_scale_size(kv_cache: torch.Tensor) -> int:
    """Elements of a cache's fp8 scale: 2 for the MHA layout (key, value), 1 for MLA's record."""
    return 2 if kv_cache.dim() == 5 else 1


def key_scale(kv_scale: torch.Tensor | None) -> torch.Tensor | None:
    return None if kv_scale is None else kv_scale.reshape(-1)[0]


def value_scale(kv_scale: torch.Tensor | None) -> torch.Tensor | None:
    return None if kv_scale is None else kv_scale.reshape(-1)[-1]


def calibrated_kv_scale(key: torch.Tensor, value: torch.Tensor, mla: bool) -> torch.Tensor:
    """The fp8 scale that maps the largest |value| written to the e4m3 maximum (amax / 448, as
    vLLM's calculate_kv_scales, without its headroom divisors): MLA [1] over the record
    kv_c ‖ k_pe, MHA [2] (keys, values). An all-zero tensor gets scale 1 (any scale stores 0)."""
    amax = torch.stack([key.detach().abs().amax().float(), value.detach().abs().amax().float()])
    if mla:
        amax = amax.amax().reshape(1)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def dequantize_cache(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """A whole cache as float32 (fp8: times its key / value scale)."""
    if kv_cache.dtype != FP8_DTYPE:
        return kv_cache.float()
    assert kv_scale is not None
    if kv_cache.dim() == 5:
        return kv_cache.float() * kv_scale.reshape(2, 1, 1, 1, 1)
    return kv_cache.float() * kv_scale.reshape(())


def quantize(x: torch.Tensor, cache_dtype_: torch.dtype, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """Values as stored in a cache of `cache_dtype_`; `kv_scale` is the one per-tensor scale of
    these values (key_scale / value_scale of a layer's kv_scale)."""
    if cache_dtype_ != FP8_DTYPE:
        return x.to(cache_dtype_)
    assert kv_scale is not None  # check_kv_scale ran at the entry
    return (x.float() / kv_scale.reshape(())).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """Cache values as float32; `kv_scale` is their one per-tensor scale (as in `quantize`)."""
    if x.dtype != FP8_DTYPE:
        return x.float()
    assert kv_scale is not None
    return x.float() * kv_scale.reshape(())


def request_slots(block_table_row: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Physical slots of a request's positions 0..seq_len-1, through its block table."""
    pos = torch.arange(seq_len, device=block_table_row.device)
    return block_table_row[pos // block_size].long() * block_size + pos % block_size


def write_slots(flat_cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor,
                padded: bool = True) -> None:
    """flat_cache[slot] = rows[i] for every slot_mapping[i] >= 0 (negative slots are padding);
    `padded` False: the caller knows there are none (check_slot_mapping says), so no mask.

    No host sync, so a CUDA graph may record it (selecting the real rows would read their count):
    a padding row writes the first real row's value to that row's slot again (the same bytes
    twice, whichever copy lands last), or, in a step with no real row, slot 0's own value back.
    """
    if not slot_mapping.numel():
        return
    if flat_cache.dtype == FP8_DTYPE:  # CPU index_copy_ has no fp8 kernel; bytes copy the same
        flat_cache, rows = flat_cache.view(torch.uint8), rows.view(torch.uint8)
    if not padded:
        flat_cache.index_copy_(0, slot_mapping, rows)
        return
    keep = slot_mapping >= 0
    first = keep.int().argmax().view(1)  # the first real row (row 0 when there is none)
    first_slot = slot_mapping.index_select(0, first).clamp(min=0)
    first_value = torch.where(keep.index_select(0, first).view(1, *[1] * (rows.dim() - 1)),
                              rows.index_select(0, first), flat_cache.index_select(0, first_slot))
    values = torch.where(keep.view(-1, *[1] * (rows.dim() - 1)), rows, first_value)
    flat_cache.index_copy_(0, torch.where(keep, slot_mapping, first_slot), values)

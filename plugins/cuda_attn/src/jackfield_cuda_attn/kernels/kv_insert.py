"""KV insert: write key and value rows into the paged MHA cache [2, blocks, block_size, H_kv, D].

Each program writes BLOCK_T tokens of one KV head, key and value. fp8 caches hold
clamp(x / scale, -448, 448) with the per-tensor scales (keys kv_scale[0], values kv_scale[1]), as
the core's `quantize`.

Slot range: every layer of a step inserts with the same slot_mapping tensor, so its range is
checked on the host once per (tensor, version, capacity) and remembered (one device sync a step,
not one a layer). The kernel also skips any slot >= capacity, so a tensor changed behind the
version counter can never cause a stray write. While a CUDA graph is being recorded the check
cannot sync: the recording engine checks the slots of every replay on the host instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from jackfield.attention.checks import check_slot_range_once
from jackfield.ops.launch import DirectLauncher

from jackfield_cuda_attn.kernels.checks import FP8, FP8_MAX, check_cache, check_device, check_scale, require

BLOCK_T = 16


@triton.jit(do_not_specialize=["num_tokens"])  # a step's token count: one compile, not three
def _kv_insert_kernel(
    key,
    value,
    k_cache,
    v_cache,
    slots,
    num_tokens,
    capacity,
    kv_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_slot,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    head = tl.program_id(1)
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slots + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    # Negative slots (padding, skipped tokens) are not written; slots past the cache never are.
    live = ((slot >= 0) & (slot < capacity))[:, None]
    d = tl.arange(0, D)[None, :]
    k = tl.load(key + tok[:, None] * stride_kt + head * stride_kh + d, mask=live).to(tl.float32)
    v = tl.load(value + tok[:, None] * stride_vt + head * stride_vh + d, mask=live).to(tl.float32)
    if QUANT:  # fp8: divide by the per-tensor scales (key, value) and saturate to the finite range
        k = tl.clamp(k / tl.load(kv_scale), -FP8_MAX, FP8_MAX)
        v = tl.clamp(v / tl.load(kv_scale + 1), -FP8_MAX, FP8_MAX)
    where = slot[:, None] * stride_slot + head * D + d
    out_ty = k_cache.dtype.element_ty
    tl.store(k_cache + where, k.to(out_ty), mask=live)
    tl.store(v_cache + where, v.to(out_ty), mask=live)


_launch_kv_insert = DirectLauncher(_kv_insert_kernel)  # Triton's dispatch outlasts a small insert


def mha_kv_insert(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Write key, value [T, H_kv, D] into kv_cache [2, blocks, block_size, H_kv, D] at slot_mapping [T].

    Slots < 0 are skipped; fp8 caches are quantized with `kv_scale` [2] (key scale, value scale;
    required). An out-of-range
    slot is a ValueError here; the check syncs once per slot_mapping (see the module docstring).
    """
    check_cache(kv_cache)
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    want = (key.shape[0] if key.dim() == 3 else -1, num_kv_heads, head_size)
    for name, rows in (("key", key), ("value", value)):
        require(
            tuple(rows.shape) == want,
            lambda name=name, rows=rows: f"{name} must be [T, {num_kv_heads}, {head_size}], "
            f"got {tuple(rows.shape)}",
        )
        require(
            rows.dtype in (torch.bfloat16, torch.float16, torch.float32),
            lambda name=name, rows=rows: f"{name} dtype {rows.dtype} must be bf16, fp16 or fp32",
        )
        require(
            rows.stride(-1) == 1,
            lambda name=name, rows=rows: f"{name} rows must be contiguous (last stride 1), "
            f"got strides {rows.stride()}",
        )
        check_device(name, rows, kv_cache.device)
    tokens = key.shape[0]
    require(
        slot_mapping.dim() == 1 and slot_mapping.numel() == tokens,
        lambda: f"slot_mapping must be [{tokens}], got {tuple(slot_mapping.shape)}",
    )
    require(
        slot_mapping.dtype in (torch.int32, torch.int64),
        lambda: f"slot_mapping dtype {slot_mapping.dtype} must be int32 or int64",
    )
    check_device("slot_mapping", slot_mapping, kv_cache.device)
    require(slot_mapping.is_contiguous(), "slot_mapping must be contiguous")
    scale = check_scale(kv_cache, kv_scale)
    if tokens == 0:
        return
    capacity = num_blocks * block_size
    check_slot_range_once(slot_mapping, num_blocks, block_size)
    _launch_kv_insert(
        (triton.cdiv(tokens, BLOCK_T), num_kv_heads),
        key,
        value,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        tokens,
        capacity,
        scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        num_kv_heads * head_size,
        D=head_size,
        BLOCK_T=BLOCK_T,
        QUANT=kv_cache.dtype == FP8,
        FP8_MAX=FP8_MAX,
        num_warps=4,
    )

"""KV insert: write kv_c ‖ k_pe rows into the paged latent cache at slot_mapping.

One kernel for every caller, including KV-only writes (drafters that insert KV with no queries).
Each program writes BLOCK_T tokens; record widths come from the cache's last dimension.

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

from jackfield_cuda_mla.kernels.checks import FP8, FP8_MAX, check_cache, check_device, check_scale, require

BLOCK_T = 16


@triton.jit
def _kv_insert_kernel(
    kv_c,
    k_pe,
    cache,
    slots,
    num_tokens,
    capacity,
    kv_scale,
    stride_c,
    stride_p,
    stride_slot,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slots + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    # Negative slots (padding, skipped tokens) are not written; slots past the cache never are.
    live = (slot >= 0) & (slot < capacity)
    base = cache + slot * stride_slot
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    mask_r = live[:, None] & (r[None, :] < RANK)
    mask_p = live[:, None] & (p[None, :] < ROPE)
    c = tl.load(kv_c + tok[:, None] * stride_c + r[None, :], mask=mask_r).to(tl.float32)
    e = tl.load(k_pe + tok[:, None] * stride_p + p[None, :], mask=mask_p).to(tl.float32)
    if QUANT:  # fp8: divide by the per-tensor scale and saturate to the finite range
        scale = tl.load(kv_scale)
        c = tl.clamp(c / scale, -FP8_MAX, FP8_MAX)
        e = tl.clamp(e / scale, -FP8_MAX, FP8_MAX)
    out_ty = cache.dtype.element_ty
    tl.store(base[:, None] + r[None, :], c.to(out_ty), mask=mask_r)
    tl.store(base[:, None] + RANK + p[None, :], e.to(out_ty), mask=mask_p)


_launch_kv_insert = DirectLauncher(_kv_insert_kernel)  # Triton's dispatch outlasts a small insert


def mla_kv_insert(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Write kv_c [T, R] and k_pe [T, P] into kv_cache [blocks, block_size, R + P] at slot_mapping [T].

    Slots < 0 are skipped; fp8 caches are quantized with `kv_scale` (required). An out-of-range
    slot is a ValueError here; the check syncs once per slot_mapping (see the module docstring).
    """
    check_cache(kv_cache)
    num_blocks, block_size, width = kv_cache.shape
    require(
        kv_c.dim() == 2 and k_pe.dim() == 2,
        lambda: f"kv_c and k_pe must be 2-D [T, *], got {tuple(kv_c.shape)} and {tuple(k_pe.shape)}",
    )
    tokens, rank = kv_c.shape
    rope = k_pe.shape[1]
    require(k_pe.shape[0] == tokens, lambda: f"kv_c has {tokens} tokens but k_pe has {k_pe.shape[0]}")
    require(
        rank + rope == width, lambda: f"kv_c width {rank} + k_pe width {rope} != cache record width {width}"
    )
    require(
        slot_mapping.dim() == 1 and slot_mapping.numel() == tokens,
        lambda: f"slot_mapping must be [{tokens}], got {tuple(slot_mapping.shape)}",
    )
    require(
        slot_mapping.dtype in (torch.int32, torch.int64),
        lambda: f"slot_mapping dtype {slot_mapping.dtype} must be int32 or int64",
    )
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        require(
            t.dtype in (torch.bfloat16, torch.float16, torch.float32),
            lambda name=name, t=t: f"{name} dtype {t.dtype} must be bf16, fp16 or fp32",
        )
        require(
            t.stride(-1) == 1,
            lambda name=name, t=t: (
                f"{name} rows must be contiguous (last stride 1), got strides {t.stride()}"
            ),
        )
        check_device(name, t, kv_cache.device)
    check_device("slot_mapping", slot_mapping, kv_cache.device)
    require(slot_mapping.is_contiguous(), "slot_mapping must be contiguous")
    scale = check_scale(kv_cache, kv_scale)
    if tokens == 0:
        return
    capacity = num_blocks * block_size
    check_slot_range_once(slot_mapping, num_blocks, block_size)
    _launch_kv_insert(
        (triton.cdiv(tokens, BLOCK_T),),
        kv_c,
        k_pe,
        kv_cache,
        slot_mapping,
        tokens,
        capacity,
        scale,
        kv_c.stride(0),
        k_pe.stride(0),
        kv_cache.stride(1),
        RANK=rank,
        ROPE=rope,
        BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_P=triton.next_power_of_2(rope),
        BLOCK_T=BLOCK_T,
        QUANT=kv_cache.dtype == FP8,
        FP8_MAX=FP8_MAX,
        num_warps=4,
    )

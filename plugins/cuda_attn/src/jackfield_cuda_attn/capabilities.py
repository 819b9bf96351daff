"""What cuda_attn supports and whether this machine can run it. Imports no kernels."""

from __future__ import annotations

import torch
from jackfield.contracts.attention import AttentionCapabilities, Availability
from jackfield.ops.gpu_checks import triton_cuda_availability

MIN_COMPUTE_CAPABILITY = (8, 0)

CUDA_ATTN_CAPABILITIES = AttentionCapabilities(
    kinds=("mha",),
    activation_dtypes=(torch.bfloat16, torch.float16),
    kv_cache_dtypes=("auto", "bfloat16", "fp8_e4m3"),
    head_sizes=(32, 64, 128, 256),  # one power-of-two tile width each (tl.dot needs >= 16)
    block_size_multiple=16,
    devices=("cuda",),
    sliding_window=True,
    sinks=True,
    non_causal=True,
    dcp=True,
    max_decode_query_len=8,
    cuda_graph="uniform_decode",  # decode reads lengths and tables on the device; no host sync
    # A 64-key tile (the decode kernel's) then lies in one block: one block-table entry a tile.
    preferred_block_size=64,
)


def cuda_attn_availability() -> Availability:
    """A CUDA device of compute capability >= 8.0 and an importable Triton; otherwise the reason."""
    return triton_cuda_availability("cuda_attn", MIN_COMPUTE_CAPABILITY)

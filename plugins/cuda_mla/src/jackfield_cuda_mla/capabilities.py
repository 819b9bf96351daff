"""What cuda_mla supports and whether this machine can run it. Imports no kernels."""

from __future__ import annotations

import torch
from jackfield.contracts.attention import AttentionCapabilities, Availability
from jackfield.ops.gpu_checks import triton_cuda_availability

MIN_COMPUTE_CAPABILITY = (8, 0)

CUDA_MLA_CAPABILITIES = AttentionCapabilities(
    kinds=("mla",),
    activation_dtypes=(torch.bfloat16, torch.float16),
    kv_cache_dtypes=("auto", "bfloat16", "fp8_e4m3"),
    head_sizes=None,  # any kv_lora_rank + rope_dim (DeepSeek: 512 + 64 = 576)
    block_size_multiple=16,
    devices=("cuda",),
    sparse_topk=True,
    non_causal=True,
    dcp=True,
    max_decode_query_len=8,
    cuda_graph="uniform_decode",  # decode reads lengths on the device; no host sync
    preferred_block_size=64,  # whole 64-key tiles a page: what the Hopper kernels' TMA loads read
)


def cuda_mla_availability() -> Availability:
    """A CUDA device of compute capability >= 8.0 and an importable Triton; otherwise the reason."""
    return triton_cuda_availability("cuda_mla", MIN_COMPUTE_CAPABILITY)

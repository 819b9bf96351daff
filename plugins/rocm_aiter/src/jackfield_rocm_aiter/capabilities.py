"""What rocm_aiter_mla supports and whether this machine can run it. Imports no kernels: the
probe imports aiter only on a ROCm build of PyTorch with a visible GPU."""

from __future__ import annotations

import torch
from jackfield.contracts.attention import AttentionCapabilities, Availability

from jackfield_rocm_aiter.platform import probe_platform

ROCM_AITER_MLA_CAPABILITIES = AttentionCapabilities(
    kinds=("mla",),
    activation_dtypes=(torch.bfloat16,),  # AITER's MLA decode reads bf16 (or fp8) queries, writes bf16
    kv_cache_dtypes=("auto", "bfloat16", "fp8_e4m3"),  # fp8 where AITER's fp8 is e4m3fn (gfx950)
    head_sizes=(576,),  # the kernels' record: kv_lora_rank 512 + rope 64
    block_size_multiple=1,  # any block size: the decode reads the cache slot by slot (page size 1)
    devices=("cuda",),  # ROCm's PyTorch device type
    non_causal=True,  # where the installed AITER and its manifest have the kernel: supports_non_causal
    dcp=True,  # returns the decode LSE
    max_decode_query_len=4,  # AITER's MLA decode kernels take up to 4 query rows a request
    # AITER's page-size-1 layout is built once per step, outside what the engine records: a replay
    # would read a stale layout. Decode steps run eagerly.
    cuda_graph="never",
)


def rocm_aiter_availability() -> Availability:
    """ROCm, an importable aiter, and AITER's MLA kernel manifest for this GPU's arch."""
    return probe_platform().availability()

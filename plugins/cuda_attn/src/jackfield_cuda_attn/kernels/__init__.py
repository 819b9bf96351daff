"""Triton kernels for MHA/GQA/MQA: KV insert and paged attention (split-KV decode, prefill)."""

from jackfield_cuda_attn.kernels.attention import MAX_DECODE_QUERY_LEN, paged_attention
from jackfield_cuda_attn.kernels.kv_insert import mha_kv_insert

__all__ = ["MAX_DECODE_QUERY_LEN", "mha_kv_insert", "paged_attention"]

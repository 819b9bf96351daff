"""Reference PyTorch ops (the oracle), LSE merge, and host-to-device staging."""

from jackfield.ops.merge import merge_attn_states
from jackfield.ops.reference import (
    dense_attention,
    paged_attention,
    varlen_attention,
    visibility_mask,
)
from jackfield.ops.staging import CpuGpuBuffer, async_tensor_h2d

__all__ = [
    "CpuGpuBuffer",
    "async_tensor_h2d",
    "dense_attention",
    "merge_attn_states",
    "paged_attention",
    "varlen_attention",
    "visibility_mask",
]

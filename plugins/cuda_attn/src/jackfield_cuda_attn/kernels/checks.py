"""Entry-point validation shared by the kernels: every bad input gets a clear error (the
checks every Triton GPU backend shares are core's, jackfield.ops.gpu_checks; re-exported here)."""

from __future__ import annotations

import torch
from jackfield.ops.gpu_checks import FP8, FP8_MAX, check_device, check_scale, require  # noqa: F401

QUERY_DTYPES = (torch.bfloat16, torch.float16)
HEAD_SIZES = (16, 32, 64, 128, 256)  # powers of two: one tile width, and tl.dot needs >= 16


def check_cache(kv_cache: torch.Tensor) -> None:
    """[2, num_blocks, block_size, H_kv, D], contiguous, a 16-bit float or fp8 dtype."""
    require(
        kv_cache.dim() == 5 and kv_cache.shape[0] == 2,
        lambda: f"kv_cache must be [2, num_blocks, block_size, H_kv, D], got {tuple(kv_cache.shape)}",
    )
    require(
        kv_cache.dtype in (*QUERY_DTYPES, FP8),
        lambda: f"kv_cache dtype {kv_cache.dtype} must be bfloat16, float16 or float8_e4m3fn",
    )
    require(kv_cache.is_contiguous(), lambda: f"kv_cache must be contiguous, got strides {kv_cache.stride()}")
    require(
        kv_cache.shape[-1] in HEAD_SIZES,
        lambda: f"head size {kv_cache.shape[-1]} is not one of {HEAD_SIZES}",
    )

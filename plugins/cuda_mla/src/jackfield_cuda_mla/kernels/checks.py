"""Entry-point validation shared by the kernels: every bad input gets a clear error (the
checks every Triton GPU backend shares are core's, jackfield.ops.gpu_checks; re-exported here)."""

from __future__ import annotations

import torch
from jackfield.ops.gpu_checks import FP8, FP8_MAX, check_device, check_scale, require  # noqa: F401

CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8)


def check_cache(kv_cache: torch.Tensor) -> None:
    require(
        kv_cache.dim() == 3,
        lambda: f"kv_cache must be [num_blocks, block_size, width], got shape {tuple(kv_cache.shape)}",
    )
    require(kv_cache.dtype in CACHE_DTYPES, lambda: f"kv_cache dtype {kv_cache.dtype} not in {CACHE_DTYPES}")
    require(
        kv_cache.stride(-1) == 1,
        lambda: f"kv_cache rows must be contiguous (last stride 1), got strides {kv_cache.stride()}",
    )
    require(
        kv_cache.stride(0) == kv_cache.shape[1] * kv_cache.stride(1),
        lambda: (
            "kv_cache blocks must be dense (stride(0) == block_size * stride(1)), "
            f"strides {kv_cache.stride()}"
        ),
    )


def cache_is_one_matrix(kv_cache: torch.Tensor) -> bool:
    """Pages back to back with 16-byte-aligned rows: the cache viewed as one [blocks x page, width]
    matrix, which is how the TMA descriptors of the Gluon kernels address it."""
    page = kv_cache.shape[1]
    return (
        kv_cache.stride(2) == 1
        and kv_cache.stride(0) == page * kv_cache.stride(1)
        and kv_cache.stride(1) * kv_cache.element_size() % 16 == 0
        and kv_cache.data_ptr() % 16 == 0
    )

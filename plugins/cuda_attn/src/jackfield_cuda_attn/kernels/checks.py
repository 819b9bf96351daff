"""Entry-point validation shared by the kernels: every bad input gets a clear error."""

from __future__ import annotations

from collections.abc import Callable

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUERY_DTYPES = (torch.bfloat16, torch.float16)
HEAD_SIZES = (16, 32, 64, 128, 256)  # powers of two: one tile width, and tl.dot needs >= 16


def require(ok: bool, message: str | Callable[[], str]) -> None:
    """Raise ValueError(message) unless ok; a callable message is only formatted on failure
    (the checks run on every attention and insert call, so eager f-strings cost host time)."""
    if not ok:
        raise ValueError(message() if callable(message) else message)


def check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    require(
        tensor.device == device,
        lambda: f"{name} is on {tensor.device}, expected {device} (where kv_cache lives)",
    )


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


def check_scale(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """The per-tensor fp8 scale tensor the kernels read (no host sync); fp8 without one fails.

    Non-fp8 caches get the kernels' unused dummy (the cache itself, never dereferenced).
    """
    if kv_cache.dtype != FP8:
        return kv_cache
    require(
        kv_scale is not None,
        "fp8 (float8_e4m3fn) kv_cache needs kv_scale (a per-tensor scale); none was given",
    )
    assert kv_scale is not None
    require(
        kv_scale.numel() == 1,
        lambda: f"kv_scale must hold one per-tensor value, got shape {tuple(kv_scale.shape)}",
    )
    require(kv_scale.dtype == torch.float32, lambda: f"kv_scale dtype {kv_scale.dtype} must be float32")
    check_device("kv_scale", kv_scale, kv_cache.device)
    return kv_scale

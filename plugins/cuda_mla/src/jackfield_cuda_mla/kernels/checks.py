"""Entry-point validation shared by the kernels: every bad input gets a clear error."""

from __future__ import annotations

from collections.abc import Callable

import torch

FP8 = torch.float8_e4m3fn
CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def require(ok: bool, message: str | Callable[[], str]) -> None:
    """Raise ValueError(message) unless ok; a callable message is only formatted on failure
    (the checks run on every decode and insert call, so eager f-strings cost real host time)."""
    if not ok:
        raise ValueError(message() if callable(message) else message)


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
        kv_scale.numel() == 1, f"kv_scale must hold one per-tensor value, got shape {tuple(kv_scale.shape)}"
    )
    require(kv_scale.dtype == torch.float32, lambda: f"kv_scale dtype {kv_scale.dtype} must be float32")
    check_device("kv_scale", kv_scale, kv_cache.device)
    return kv_scale


def check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    require(
        tensor.device == device, f"{name} is on {tensor.device}, expected {device} (where kv_cache lives)"
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

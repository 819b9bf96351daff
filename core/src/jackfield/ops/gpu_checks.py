"""What every Triton GPU backend checks: whether this machine can run Triton kernels on CUDA (the
availability probe; imports no kernels), and the entry checks its kernels share."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from jackfield.contracts.attention import Availability

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def triton_cuda_availability(backend: str, min_compute_capability: tuple[int, int]) -> Availability:
    """A CUDA device of at least `min_compute_capability` and an importable Triton; else the reason."""
    if importlib.util.find_spec("triton") is None:
        return Availability.no("triton is not installed (pip install triton)")
    if not torch.cuda.is_available():
        return Availability.no("no CUDA device is visible to PyTorch")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < min_compute_capability:
        want = ".".join(map(str, min_compute_capability))
        return Availability.no(f"{torch.cuda.get_device_name()} has compute capability {major}.{minor}; "
                               f"{backend} needs >= {want}")
    return Availability.yes(f"{torch.cuda.get_device_name()} (sm_{major}{minor}) with Triton")


def require(ok: bool, message: str | Callable[[], str]) -> None:
    """Raise ValueError(message) unless ok; a callable message is only formatted on failure
    (the checks run on every kernel call, so eager f-strings cost host time)."""
    if not ok:
        raise ValueError(message() if callable(message) else message)


def check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    require(
        tensor.device == device,
        lambda: f"{name} is on {tensor.device}, expected {device} (where kv_cache lives)",
    )


def check_scale(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """The per-tensor fp8 scales the kernels read (no host sync); fp8 without them fails: [1] for
    an MLA cache (3-D), [2] (key scale at element 0, value scale at 1) for an MHA cache (5-D).

    Non-fp8 caches get the kernels' unused dummy (the cache itself, never dereferenced).
    """
    if kv_cache.dtype != FP8:
        return kv_cache
    require(
        kv_scale is not None,
        "fp8 (float8_e4m3fn) kv_cache needs kv_scale (per-tensor scales); none was given",
    )
    assert kv_scale is not None
    mha = kv_cache.dim() == 5
    require(
        kv_scale.numel() == (2 if mha else 1) and kv_scale.is_contiguous(),
        lambda: ("kv_scale must hold two per-tensor values (key, value) of an MHA cache" if mha
                 else "kv_scale must hold one per-tensor value (an MLA cache's record)")
        + f", contiguous; got shape {tuple(kv_scale.shape)}",
    )
    require(kv_scale.dtype == torch.float32, lambda: f"kv_scale dtype {kv_scale.dtype} must be float32")
    check_device("kv_scale", kv_scale, kv_cache.device)
    return kv_scale

"""The AITER installation this process would call, probed once: the GPU's arch, its kernel
manifest, the fp8 format AITER's kernels read there and the decode entry point. Fails closed with
the reason: not ROCm, aiter not importable, an arch without a manifest.

Also what the machine answers about one kind of decode batch (`AiterPlatform.decode_refusals`):
the backend's validate(), supports_non_causal() and each call's entry check all ask it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from jackfield.attention.kv_cache import FP8_DTYPE
from jackfield.contracts.attention import Availability, KVCacheDType

from jackfield_rocm_aiter.manifest import SERVED_NUM_HEADS, KernelManifest, read_manifest


@dataclass(frozen=True)
class AiterPlatform:
    arch: str  # "gfx942", "gfx950", ...
    manifest: KernelManifest
    fp8_dtype: torch.dtype  # what AITER's fp8 kernels read on this arch (aiter.dtypes.fp8)
    # aiter.mla.mla_decode_fwd (or, in tests, an emulator with its signature)
    mla_decode_fwd: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]

    @property
    def decode_takes_causal(self) -> bool:
        """Whether the installed mla_decode_fwd has a `causal` parameter (older AITER is causal only)."""
        return "causal" in inspect.signature(self.mla_decode_fwd).parameters

    def decode_refusals(
        self,
        kv_cache_dtype: KVCacheDType,
        query_len: int,
        causal: bool,
        num_heads: Sequence[int] = SERVED_NUM_HEADS,
    ) -> list[str]:
        """Why AITER here cannot attend, over a `kv_cache_dtype` cache, to decode batches whose
        longest request has `query_len` rows, for each of `num_heads` (empty: it can)."""
        reasons = []
        fp8 = kv_cache_dtype == "fp8_e4m3"
        if fp8 and self.fp8_dtype != FP8_DTYPE:
            reasons.append(f"AITER's fp8 kernels on {self.arch} read {self.fp8_dtype}, but a fp8_e4m3 "
                           f"KV cache holds {FP8_DTYPE}")
        if not causal and query_len > 1 and not self.decode_takes_causal:
            reasons.append("the installed aiter.mla.mla_decode_fwd has no `causal` parameter (causal only)")
        # An fp8 cache takes fp8 queries: AITER's non-persistent decode has no bf16-over-fp8 kernel.
        q_type = kv_type = "fp8" if fp8 else "bf16"
        for heads in num_heads:
            missing = self.manifest.missing_decode_kernel(q_type, kv_type, heads, query_len, causal)
            if missing:
                reasons.append(missing)
        return reasons


@dataclass(frozen=True)
class PlatformProbe:
    """The probe's answer: a platform, or why there is none."""

    platform: AiterPlatform | None
    reason: str

    def availability(self) -> Availability:
        return Availability(self.platform is not None, self.reason)


def gfx_arch(gcn_arch_name: str) -> str:
    """The arch of a ROCm device's gcnArchName: "gfx942:sramecc+:xnack-" -> "gfx942"."""
    arch = gcn_arch_name.split(":")[0].strip()
    if not arch.startswith("gfx"):
        raise ValueError(f"gcnArchName {gcn_arch_name!r} names no gfx arch")
    return arch


def manifest_path(asm_dir: Path, arch: str) -> Path:
    return asm_dir / arch / "mla" / "mla_asm.csv"


def platform_from(
    arch: str,
    asm_dir: Path,
    fp8_dtype: torch.dtype,
    mla_decode_fwd: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
) -> PlatformProbe:
    """The platform of an AITER whose kernels live under `asm_dir` (AITER_ASM_DIR), on `arch`."""
    path = manifest_path(asm_dir, arch)
    if not path.is_file():
        return PlatformProbe(None, f"AITER has no MLA kernel manifest for {arch} ({path} does not exist)")
    try:
        manifest = read_manifest(path, arch)
    except (OSError, ValueError) as exc:
        return PlatformProbe(None, f"AITER's MLA kernel manifest is unreadable: {exc}")
    platform = AiterPlatform(arch, manifest, fp8_dtype, mla_decode_fwd)
    return PlatformProbe(platform, f"AITER MLA decode on {arch} ({len(manifest.kernels)} kernels in {path})")


@functools.cache
def probe_platform() -> PlatformProbe:
    """This process's AITER platform, probed once (the answer cannot change while it runs)."""
    if torch.version.hip is None:
        return PlatformProbe(None, "not a ROCm build of PyTorch (torch.version.hip is None)")
    if not torch.cuda.is_available():
        return PlatformProbe(None, "no ROCm GPU is visible to PyTorch")
    try:
        aiter = importlib.import_module("aiter")
        mla = importlib.import_module("aiter.mla")
    except Exception as exc:  # noqa: BLE001 - any failure to import (JIT, missing .so) is the reason
        return PlatformProbe(None, f"aiter is not importable ({type(exc).__name__}: {exc})")
    try:
        arch = gfx_arch(torch.cuda.get_device_properties(0).gcnArchName)
    except ValueError as exc:
        return PlatformProbe(None, str(exc))
    # Importing aiter sets AITER_ASM_DIR (aiter/jit/core.py), the directory its kernel loader reads.
    asm_dir = os.environ.get("AITER_ASM_DIR")
    if not asm_dir:
        return PlatformProbe(None, "AITER_ASM_DIR is not set after importing aiter")
    return platform_from(arch, Path(asm_dir), aiter.dtypes.fp8, mla.mla_decode_fwd)

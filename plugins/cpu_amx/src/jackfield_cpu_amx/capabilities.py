"""What cpu_amx supports, and whether this CPU and OS let it use the AMX tile units.

Light on purpose: `jackfield plugins` imports this to list the backend, so no kernels here
(availability() imports the native kernel's module when asked).
AMX needs three things: the CPU flags amx_tile and amx_bf16, and the Linux kernel granting this
process the AMX tile-data state (arch_prctl ARCH_REQ_XCOMP_PERM, the same request oneDNN and
PyTorch make before their first AMX instruction). Without them the backend runs its AVX-512
float32 path instead.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from jackfield.contracts.attention import AttentionCapabilities, Availability

ComputePath = Literal["amx_bf16", "avx512_fp32"]

CPU_AMX_CAPABILITIES = AttentionCapabilities(
    kinds=("mla", "mha"),
    activation_dtypes=(torch.bfloat16, torch.float32),
    kv_cache_dtypes=("auto", "bfloat16"),
    head_sizes=None,
    block_size_multiple=1,
    devices=("cpu",),
    sliding_window=True,
    sinks=True,
    non_causal=True,
    dcp=True,
    max_decode_query_len=8,
    cuda_graph="never",
    preferred_block_size=64,
)

_SYS_ARCH_PRCTL = 158  # x86-64 syscall number
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_AMX_FLAGS = ("amx_tile", "amx_bf16")


@dataclass(frozen=True)
class AmxStatus:
    enabled: bool
    reason: str

    @property
    def path(self) -> ComputePath:
        return "amx_bf16" if self.enabled else "avx512_fp32"


def read_cpu_flags(cpuinfo_path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The flags of the first CPU in /proc/cpuinfo (empty where there is no such file)."""
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:  # no /proc (not Linux): no flags, so the float32 path
        return frozenset()
    return frozenset()


def request_amx_permission() -> str | None:
    """Ask Linux for the AMX tile-data state; None when granted, else why not."""
    if not sys.platform.startswith("linux"):
        return f"AMX tile state is requested through Linux arch_prctl; this is {sys.platform}"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        return f"the kernel refused ARCH_REQ_XCOMP_PERM (errno {ctypes.get_errno()})"
    granted = ctypes.c_uint64(0)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(granted)) != 0:
        return f"ARCH_GET_XCOMP_PERM failed (errno {ctypes.get_errno()})"
    if not granted.value >> _XFEATURE_XTILEDATA & 1:
        return f"the kernel did not grant XTILEDATA (permitted features {granted.value:#x})"
    return None


def amx_status(
    flags: frozenset[str] | None = None,
    request_permission: Callable[[], str | None] = request_amx_permission,
) -> AmxStatus:
    """Decide the compute path from the CPU flags and the OS grant (both injectable for tests)."""
    flags = read_cpu_flags() if flags is None else flags
    missing = [flag for flag in _AMX_FLAGS if flag not in flags]
    if missing:
        avx512 = "avx512f" in flags
        fallback = "AVX-512 float32" if avx512 else "float32 (no AVX-512 either)"
        return AmxStatus(False, f"CPU lacks {', '.join(missing)}: {fallback} path")
    refused = request_permission()
    if refused is not None:
        return AmxStatus(False, f"CPU has AMX-BF16 but {refused}: AVX-512 float32 path")
    return AmxStatus(True, "AMX-BF16 tiles granted by the OS: BF16 matrix-unit path")


@functools.cache
def detected_amx_status() -> AmxStatus:
    """This process's answer, asked once (the OS grant lasts for the process)."""
    return amx_status()


def is_amx_bmm_enabled() -> bool:
    """Whether bf16 matmuls here run on the AMX tile units (CPU flags + OS permission)."""
    return detected_amx_status().enabled


def availability(status: AmxStatus | None = None) -> Availability:
    """The backend runs on any x86-64 CPU; the reason says which path and which decode kernel are
    active, and why. On an AMX host this builds the native kernel (once: it is cached on disk)."""
    status = detected_amx_status() if status is None else status
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return Availability.no(f"cpu_amx needs an x86-64 CPU, this is {machine}")
    from jackfield_cpu_amx.native import decode_kernel_name, native_decode_kernel  # builds: not at import

    kernel = native_decode_kernel() if status.enabled else "no AMX tiles"
    return Availability.yes(
        f"{status.path}: {status.reason}; MLA decode: {decode_kernel_name(kernel)}; "
        "MHA: PyTorch's CPU flash kernel"
    )

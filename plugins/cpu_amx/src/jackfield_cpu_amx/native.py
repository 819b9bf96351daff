"""The native AMX decode kernel (native/mla_decode.c): which build is active, which groups it
takes, and the call through ctypes.

The backend decodes with it when this process has the AMX tiles (capabilities.py), the source
built, and the group fits (`unfit_reason`); otherwise with the PyTorch flash kernel
(kernels.py), and `decode_kernel_name` says why. An A/B of the two in one process passes a
reason as `CpuAmxMLAImpl(native_kernel=...)`, which keeps that impl on the PyTorch kernels.

The backend only ever builds the "amx" flavour. Two more flavours of the same source exist for
tests, so that the kernel is checked where the instructions are missing: "emulated_tiles" (the
four tile operations as C loops, the AVX-512 code as in the AMX build; any AVX-512-BF16 CPU)
and "portable" (also the AVX-512 intrinsics in plain C, from native/portable_simd.h; any CPU
and C compiler). Their outputs equal each other bit for bit; the AMX tiles' float32 sums may
round differently.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Literal

import torch

from jackfield_cpu_amx.capabilities import AmxStatus, detected_amx_status, read_cpu_flags
from jackfield_cpu_amx.native_build import SOURCE_DIR, NativeBuildError, build_library
from jackfield_cpu_amx.plan import NATIVE_MAX_Q_LEN, DecodeTables, NativeLayout

SOURCE = SOURCE_DIR / "mla_decode.c"
PORTABLE_HEADER = SOURCE_DIR / "portable_simd.h"
# The AVX-512 subsets the source uses besides AMX (every AMX-BF16 CPU has them).
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")

Flavour = Literal["amx", "emulated_tiles", "portable"]
# -ffp-contract=off: a * b + c in the C code is never fused, on any CPU, so the flavours agree.
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-std=gnu11", "-ffp-contract=off")
AVX512_COMPILER_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16")
FLAVOUR_FLAGS: dict[Flavour, tuple[str, ...]] = {
    "amx": AVX512_COMPILER_FLAGS + ("-mamx-tile", "-mamx-bf16"),
    "emulated_tiles": AVX512_COMPILER_FLAGS + ("-DJF_EMULATE_TILES",),
    # -Wno-psabi: GCC notes that 64-byte vector arguments change the ABI without AVX-512; they
    # only pass between the file's own static functions.
    "portable": ("-DJF_PORTABLE", "-Wno-psabi"),
}
LIBS = ("-lm",)

_INT32, _INT64, _FLOAT, _PTR = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class NativeKernel:
    """A loaded build of mla_decode.c."""

    def __init__(self, library: Path) -> None:
        self.path = library
        # torch is imported first, so the library's libgomp.so.1 binds to torch's copy (one OpenMP runtime).
        self._decode = ctypes.CDLL(str(library)).jf_mla_decode
        self._decode.restype = _INT32
        self._decode.argtypes = (
            [_PTR, _PTR, _PTR, _INT64, _PTR, _PTR]  # query, cache, table + stride, seq_lens, visible
            + [_INT32] * 6  # requests, q_len, heads, kv_lora_rank, record width, block size
            + [_INT32, _INT32, _FLOAT]  # splits, keys per split, scale
            + [_PTR, _PTR, _INT32]  # out, lse, threads
        )

    @classmethod
    def build(cls, flavour: Flavour = "amx", cache: Path | None = None) -> NativeKernel:
        """Builds (or finds in the cache) and loads the package's source; raises NativeBuildError."""
        headers = (PORTABLE_HEADER,) if flavour == "portable" else ()
        return cls(build_library(SOURCE, BASE_FLAGS + FLAVOUR_FLAGS[flavour], LIBS, cache, headers))

    def decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        tables: DecodeTables,
        layout: NativeLayout,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        """query [reqs * q_len, H, L+R] bf16 over kv_cache [blocks, block size, L+R] bf16; writes
        out [reqs * q_len, H, L] bf16 and lse [reqs * q_len, H] float32 (natural log of the scaled
        scores' sum; -inf, with out 0, for a row that sees no key). Every argument is checked: the
        C side trusts its pointers."""
        _check_decode_args(query, kv_cache, tables, layout, out, lse)
        num_reqs, num_heads = tables.seq_lens.numel(), query.shape[1]
        status = self._decode(
            query.data_ptr(),
            kv_cache.data_ptr(),
            tables.block_table.data_ptr(),
            tables.block_table.stride(0),
            tables.seq_lens.data_ptr(),
            tables.visible_keys.data_ptr(),
            num_reqs,
            tables.q_len,
            num_heads,
            out.shape[2],
            kv_cache.shape[2],
            kv_cache.shape[1],
            layout.num_splits,
            layout.split_keys,
            scale,
            out.data_ptr(),
            lse.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("the native MLA decode kernel could not allocate its buffers")


def _check_decode_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    tables: DecodeTables,
    layout: NativeLayout,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Attribute checks only (no tensor reads: this runs per layer). The tables' contents were
    checked when the layout was built for them (plan.RequestGroup.native_layout)."""
    for name, tensor, dtype in (
        ("query", query, torch.bfloat16),
        ("kv_cache", kv_cache, torch.bfloat16),
        ("out", out, torch.bfloat16),
        ("lse", lse, torch.float32),
    ):
        if tensor.dtype != dtype or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"native decode: {name} must be a contiguous CPU {dtype} tensor")
    if layout.tables is not tables:
        raise ValueError("native decode: the layout was built for other tables")
    for name, tensor in (("block_table", tables.block_table), ("seq_lens", tables.seq_lens),
                         ("visible_keys", tables.visible_keys)):
        if tensor.dtype != torch.int32 or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"native decode: {name} must be a contiguous CPU int32 tensor")
    rows = tables.seq_lens.numel() * tables.q_len
    if tables.visible_keys.numel() != rows or tables.block_table.shape[0] != tables.seq_lens.numel():
        raise ValueError(
            f"native decode: tables for {tables.seq_lens.numel()} requests of {tables.q_len} tokens hold "
            f"{tables.visible_keys.numel()} visible counts and {tables.block_table.shape[0]} table rows"
        )
    if (
        query.dim() != 3
        or query.shape[0] != rows
        or kv_cache.dim() != 3
        or kv_cache.shape[2] != query.shape[2]
    ):
        raise ValueError(
            f"native decode: query {tuple(query.shape)} and cache {tuple(kv_cache.shape)} do not fit "
            f"{tables.seq_lens.numel()} requests of {tables.q_len} tokens"
        )
    if out.dim() != 3 or out.shape[:2] != query.shape[:2] or lse.shape != query.shape[:2]:
        raise ValueError(
            f"native decode: out {tuple(out.shape)} and lse {tuple(lse.shape)} must start with "
            f"{tuple(query.shape[:2])}"
        )
    unfit = shape_unfit_reason(query.shape[2], out.shape[2], kv_cache.shape[1], tables.q_len)
    if unfit is not None:
        raise ValueError(f"native decode: {unfit}")
    low, high = layout.block_span
    if layout.block_size != kv_cache.shape[1] or low < 0 or high >= kv_cache.shape[0]:
        raise ValueError(
            f"native decode: the layout is for blocks {low}..{high} of {layout.block_size} keys, "
            f"the cache has {kv_cache.shape[0]} of {kv_cache.shape[1]}"
        )


def shape_unfit_reason(width: int, kv_lora_rank: int, block_size: int, q_len: int) -> str | None:
    """Why the native kernel cannot take these shapes, or None."""
    if width % 32:
        return f"kv_lora_rank + rope = {width} is not a multiple of 32 (one tile k-step)"
    if kv_lora_rank % 16 or not 0 < kv_lora_rank <= width:
        return f"kv_lora_rank {kv_lora_rank} is not a positive multiple of 16 up to {width}"
    if block_size <= 0 or block_size % 16:
        return f"block size {block_size} is not a positive multiple of 16 (one key tile)"
    if not 0 < q_len <= NATIVE_MAX_Q_LEN:
        return f"q_len {q_len} is not in 1..{NATIVE_MAX_Q_LEN} (prefill)"
    return None


def unfit_reason(query: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int, q_len: int) -> str | None:
    """Why the native kernel cannot decode this group, or None (then the backend uses it). The
    cache is contiguous: the common checks require it."""
    if query.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16:
        return f"needs bfloat16 activations and cache, got {query.dtype} and {kv_cache.dtype}"
    return shape_unfit_reason(kv_cache.shape[-1], kv_lora_rank, kv_cache.shape[1], q_len)


def select_native_kernel(status: AmxStatus, cpu_flags: frozenset[str]) -> NativeKernel | str:
    """The AMX build of the kernel, or why the backend does without it."""
    if not status.enabled:
        return f"no AMX tiles ({status.reason})"
    missing = [flag for flag in AVX512_FLAGS if flag not in cpu_flags]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    try:
        return NativeKernel.build()
    except NativeBuildError as exc:
        return f"native build failed: {exc}"
    except (OSError, AttributeError) as exc:  # an unwritable cache, a library that will not load
        return f"native kernel unavailable: {type(exc).__name__}: {exc}"


@functools.cache
def native_decode_kernel() -> NativeKernel | str:
    """This process's answer, built (or found in the cache) once."""
    return select_native_kernel(detected_amx_status(), read_cpu_flags())


def decode_kernel_name(kernel: NativeKernel | str) -> str:
    return "native AMX kernel" if isinstance(kernel, NativeKernel) else f"PyTorch flash kernel: {kernel}"

"""What the Gluon Hopper kernels share: the API names that differ between Triton releases, and the
shared-memory layouts of their TMA boxes."""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

# Triton 3.6 (the H200 image) names the TMA load async_copy_global_to_shared, later releases
# async_load (the old name raises there), with the same arguments; likewise the CTA-wide barrier:
# thread_barrier in 3.6, barrier later.
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


@functools.cache
def smem_layout(box: tuple[int, ...], dtype: gl.dtype) -> gl.NVMMASharedLayout:
    """The swizzled layout a TMA box lands in (kept: computing it costs ~15 us of host time a call)."""
    return gl.NVMMASharedLayout.get_default_for(list(box), dtype)


@gluon.jit
def _reinterpret_36(buffer, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    return buffer._reinterpret(dtype, shape, layout)


@gluon.jit
def _reinterpret_39(buffer, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    return buffer.reinterpret(dtype, shape, layout)


# A shared-memory buffer viewed with another dtype, shape and layout: _reinterpret in Triton 3.6,
# reinterpret later.
smem_reinterpret = _reinterpret_39 if hasattr(gl.shared_memory_descriptor, "reinterpret") else _reinterpret_36

"""Launching Triton (and Gluon) kernels without Triton's per-call dispatch.

`kernel[grid](*args, **kwargs)` binds the arguments, computes a specialization key from them,
looks the compiled kernel up, checks the kernel's globals, builds launch metadata for the launch
hooks and calls the hooks, every call: ~75 us of host time a launch on the H200's host
(benchmarks/notes_sampler.md), more than the GPU needs for the sampler's stage 2 or a decode
step's attention of one layer. `DirectLauncher` does the
first launch of each specialization through that path, keeps the CompiledKernel it returns, and
afterwards calls its launcher directly (`CompiledKernel.run`, the call Triton 3.6 and 3.9 make
themselves at the end of `JITFunction.run`).

The key under which a compiled kernel is kept is never coarser than Triton's specialization, so
a kept kernel is only reused for arguments Triton would have compiled the same way: for a tensor,
its dtype and whether its address is a multiple of 16; for a TMA tensor descriptor (Triton's or
Gluon's), its base's dtype and every field but the base, shape and strides (block
shape, shared-memory layout, padding, ...: Triton specializes on block shape, dtype and layout);
for an int, whether it is 1, a multiple of
16, and its integer type (i32, i64 or u64); bools, floats and constexpr parameters by value; the
options (num_warps, ...) and the current device. Anything else, and any launch while a Triton
launch hook is installed (profilers), takes Triton's own path: a no-op hook is also how a test or
a benchmark runs the same calls through Triton's dispatch to compare the two.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

_INT32_RANGE = range(-(2**31), 2**31)
_UINT64_START = 2**63


def _descriptor_types() -> tuple[type, ...]:
    try:  # Gluon's descriptor (with a shared-memory layout) is its own class
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    except ImportError:
        return (TensorDescriptor,)
    return (TensorDescriptor, GluonTensorDescriptor)


_DESCRIPTOR_TYPES = _descriptor_types()
_PER_LAUNCH_FIELDS = {"base", "shape", "strides"}  # encoded into the launch, not the compiled kernel


@functools.cache
def _descriptor_key_fields(descriptor_type: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(descriptor_type) if f.name not in _PER_LAUNCH_FIELDS)


def _hashable(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


def _runtime_value_key(value: object) -> object:
    """What Triton's specialization can depend on, for a value passed to a non-constexpr
    parameter (finer than Triton where that is cheaper to compute)."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, _DESCRIPTOR_TYPES):  # Triton asserts the base 16-byte aligned
        fields = _descriptor_key_fields(type(value))
        return (type(value), value.base.dtype, *(_hashable(getattr(value, name)) for name in fields))
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value == 1, value % 16 == 0, value in _INT32_RANGE, value >= _UINT64_START)
    if isinstance(value, float):
        return ("float",)
    if value is None or isinstance(value, str):
        return ("other", value)
    return _UNKEYED


# A value the key cannot describe (tuples, lists, other descriptor kinds): Triton launches the
# call and nothing is kept (a kept kernel keyed by such a value could be wrong, or keep it alive).
_UNKEYED = object()


def _triton_path_required(kernel: JITFunction) -> bool:
    """Whether Triton's own path must launch: a launch hook is set (3.6+: hook chains), or a
    setting Triton folds into each launch's compile options or checks per launch (debug mode,
    instrumentation, float sanitizer casts, a stage-inspection hook, pre-run hooks) is on. A kept
    kernel was compiled without them."""
    runtime, compilation = triton.knobs.runtime, triton.knobs.compilation
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return bool(
        runtime.debug
        or getattr(runtime, "add_stages_inspection_hook", None) is not None
        or getattr(compilation, "instrumentation_mode", "")
        or getattr(compilation, "fpsan_homomorphic_casts", False)
        or getattr(kernel, "pre_run_hooks", None)
    )


class DirectLauncher:
    """`launcher(grid, *args, **kwargs)` launches `kernel` like `kernel[grid](*args, **kwargs)`.

    kwargs holds the parameters not passed positionally (by name, as for Triton) and Triton's
    compile options (num_warps, maxnreg, enable_fp_fusion, ...). Interpreted kernels
    (TRITON_INTERPRET=1) always take Triton's path.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.direct_capable = isinstance(kernel, JITFunction)
        self._compiled: dict[tuple, Any] = {}
        self._stream_of: Callable[[int], int] | None = None
        if self.direct_capable:
            self._names: tuple[str, ...] = tuple(kernel.arg_names)
            self._params = frozenset(self._names)
            constexprs = set(kernel.constexprs)
            self._is_constexpr: tuple[bool, ...] = tuple(i in constexprs for i in range(len(self._names)))
        # Launches that went straight to the compiled kernel (tests and the benchmark read it).
        self.direct_launches = 0

    def __call__(self, grid: Sequence[int], *args: object, **kwargs: object) -> None:
        if not self.direct_capable or _triton_path_required(self.kernel):
            self.kernel[grid](*args, **kwargs)
            return
        values = args + tuple(kwargs[name] for name in self._names[len(args) :])
        options = tuple((name, value) for name, value in kwargs.items() if name not in self._params)
        device = torch.cuda.current_device()
        value_keys = tuple(
            value if constexpr else _runtime_value_key(value)
            for value, constexpr in zip(values, self._is_constexpr, strict=True)
        )
        key = (device, options, value_keys)
        keyable = not any(k is _UNKEYED for k in value_keys)
        try:
            compiled = self._compiled.get(key) if keyable else None
        except TypeError:  # an unhashable constexpr or option value
            compiled, keyable = None, False
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)
            # Under Triton's AsyncCompileMode the launch returns a future of the kernel (the
            # launch itself already waited for it): keep the kernel, not the future.
            result = getattr(compiled, "result", None)
            if callable(result) and not hasattr(type(compiled), "run"):
                compiled = result()
            if keyable and all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")):
                self._compiled[key] = compiled
            return
        if self._stream_of is None:
            self._stream_of = triton.runtime.driver.active.get_current_stream
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        # No launch metadata and no hooks: there are none (checked above).
        compiled.run(
            grid[0], grid_y, grid_z, self._stream_of(device), compiled.function, compiled.packed_metadata,
            None, None, None, *values,
        )  # fmt: skip
        self.direct_launches += 1

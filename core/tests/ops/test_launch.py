"""DirectLauncher: which launches reuse a kept compiled kernel, and what they pass to it.

Triton's dispatch and the compiled kernel are replaced by recorders (this machine has no GPU);
the GPU tests in test_sample.py run the real launcher against Triton's own path."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
import triton
import triton.language as tl
from jackfield.ops.launch import DirectLauncher
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor


def _copy_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n) * scale, mask=i < n)


@dataclass
class RecordedCompiled:
    """Stands in for Triton's CompiledKernel: records the launcher calls it receives."""

    function: int = 0xF00
    packed_metadata: tuple = (1, 1, 0)
    runs: list[tuple] = field(default_factory=list)

    def run(self, *args: object) -> None:
        self.runs.append(args)


@dataclass
class RecordedDispatch:
    """Stands in for `kernel[grid](...)`: records each call and returns a new compiled kernel."""

    calls: list[tuple] = field(default_factory=list)
    compiled: list[RecordedCompiled] = field(default_factory=list)

    def __getitem__(self, grid: tuple[int, ...]):
        def launch_through_triton(*args: object, **kwargs: object) -> RecordedCompiled:
            self.calls.append((grid, args, kwargs))
            self.compiled.append(RecordedCompiled())
            return self.compiled[-1]

        return launch_through_triton


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[DirectLauncher, RecordedDispatch]]:
    kernel = JITFunction(_copy_kernel)  # a real JIT function, also under TRITON_INTERPRET=1
    launcher = DirectLauncher(kernel)
    dispatch = RecordedDispatch()
    monkeypatch.setattr(launcher, "kernel", dispatch)
    monkeypatch.setattr(launcher, "_stream_of", lambda device: 1000 + device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    yield launcher, dispatch


def fresh(n: int) -> torch.Tensor:
    return torch.randn(n)  # torch's generator, seeded per test by the jackfield pytest plugin


def test_second_launch_goes_straight_to_the_kept_kernel_with_every_argument_in_order(recorded) -> None:
    launcher, dispatch = recorded
    x, out = fresh(64), torch.empty(64)
    launcher((4,), x, out, 64, 0.5, BLOCK=16, FLAG=True, num_warps=2)
    assert len(dispatch.calls) == 1 and launcher.direct_launches == 0
    y, out2 = fresh(64), torch.empty(64)
    launcher((4, 2), y, out2, 48, 1.5, FLAG=True, BLOCK=16, num_warps=2)
    assert len(dispatch.calls) == 1 and launcher.direct_launches == 1
    (run,) = dispatch.compiled[0].runs
    assert run[:9] == (4, 2, 1, 1003, 0xF00, (1, 1, 0), None, None, None)
    assert run[9] is y and run[10] is out2 and run[11:] == (48, 1.5, 16, True)  # signature order


@pytest.mark.parametrize(
    "change",
    [
        "unaligned tensor",
        "other dtype",
        "n == 1",
        "n not a multiple of 16",
        "n past int32",
        "constexpr value",
        "option value",
        "other device",
    ],
)
def test_anything_triton_specializes_on_compiles_through_triton(recorded, monkeypatch, change: str) -> None:
    launcher, dispatch = recorded
    x, out = fresh(80), torch.empty(80)
    args: list = [x[:64], out[:64], 64, 0.5]
    kwargs: dict = {"BLOCK": 16, "FLAG": False, "num_warps": 4}
    launcher((1,), *args, **kwargs)
    if change == "unaligned tensor":
        args[0] = x[1:65]  # 4 bytes past a 16-byte boundary
    elif change == "other dtype":
        args[1] = torch.empty(64, dtype=torch.float16)
    elif change == "n == 1":
        args[2] = 1
    elif change == "n not a multiple of 16":
        args[2] = 63
    elif change == "n past int32":
        args[2] = 2**40
    elif change == "constexpr value":
        kwargs["BLOCK"] = 32
    elif change == "option value":
        kwargs["num_warps"] = 8
    else:
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 4)
    launcher((1,), *args, **kwargs)
    assert len(dispatch.calls) == 2 and launcher.direct_launches == 0
    launcher((1,), *args, **kwargs)  # now kept under its own key
    assert len(dispatch.calls) == 2 and launcher.direct_launches == 1
    assert len(dispatch.compiled[1].runs) == 1 and not dispatch.compiled[0].runs


def test_installed_launch_hooks_take_triton_s_path(recorded) -> None:
    launcher, dispatch = recorded
    x, out = fresh(32), torch.empty(32)
    launcher((2,), x, out, 32, 2.0, BLOCK=16, FLAG=False)
    seen: list = []
    hooks = triton.knobs.runtime.launch_enter_hook
    hooks.add(seen.append)
    try:
        launcher((2,), x, out, 32, 2.0, BLOCK=16, FLAG=False)
    finally:
        hooks.remove(seen.append)
    assert len(dispatch.calls) == 2 and launcher.direct_launches == 0
    launcher((2,), x, out, 32, 2.0, BLOCK=16, FLAG=False)
    assert launcher.direct_launches == 1


@pytest.mark.parametrize("setting", ["debug", "instrumentation", "fpsan", "stage inspection", "pre-run hook"])
def test_settings_triton_folds_into_each_launch_take_triton_s_path(recorded, monkeypatch, setting) -> None:
    """A kept kernel was compiled without them: turning one on after the first launch must reach
    Triton's dispatch (which recompiles or runs the hook), not the kept kernel."""
    launcher, dispatch = recorded
    x, out = fresh(32), torch.empty(32)
    launcher((2,), x, out, 32, 2.0, BLOCK=16, FLAG=False)
    if setting == "debug":
        monkeypatch.setattr(triton.knobs.runtime, "debug", True)
    elif setting == "instrumentation":
        monkeypatch.setattr(triton.knobs.compilation, "instrumentation_mode", "consan")
    elif setting == "fpsan":
        monkeypatch.setattr(triton.knobs.compilation, "fpsan_homomorphic_casts", True)
    elif setting == "stage inspection":
        monkeypatch.setattr(triton.knobs.runtime, "add_stages_inspection_hook", lambda: ("k", "h"))
    else:
        monkeypatch.setattr(launcher.kernel, "pre_run_hooks", [lambda *a, **k: None], raising=False)
    launcher((2,), x, out, 32, 2.0, BLOCK=16, FLAG=False)
    assert len(dispatch.calls) == 2 and launcher.direct_launches == 0


def test_an_asynchronous_compile_keeps_the_kernel_not_the_future(recorded) -> None:
    """Under Triton's AsyncCompileMode the first launch returns a future of the kernel: the
    kernel it resolves to is kept, and later launches call it directly."""
    launcher, _ = recorded
    kernel = RecordedCompiled()

    class Future:  # as triton.runtime._async_compile.FutureKernel: result() gives the kernel
        def result(self) -> RecordedCompiled:
            return kernel

    calls: list = []

    class AsyncDispatch:
        def __getitem__(self, grid: tuple[int, ...]):
            return lambda *args, **kwargs: calls.append(args) or Future()

    launcher.kernel = AsyncDispatch()
    x, out = fresh(32), torch.empty(32)
    for _ in range(3):
        launcher((2,), x, out, 32, 2.0, BLOCK=16, FLAG=False)
    assert len(calls) == 1 and launcher.direct_launches == 2 and len(kernel.runs) == 2


def test_a_launch_returning_no_kernel_is_not_kept(recorded) -> None:
    """Whatever Triton returns without a launcher (None from a warm-up-only path) is not kept."""
    launcher, _ = recorded
    calls: list = []

    class NoKernelDispatch:
        def __getitem__(self, grid: tuple[int, ...]):
            return lambda *args, **kwargs: calls.append(args)

    launcher.kernel = NoKernelDispatch()
    x, out = fresh(32), torch.empty(32)
    for _ in range(2):
        launcher((2,), x, out, 32, 2.0, BLOCK=16, FLAG=False)
    assert len(calls) == 2 and launcher.direct_launches == 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_interpreted_kernels_always_take_triton_s_path() -> None:
    kernel = triton.jit(_copy_kernel)
    launcher = DirectLauncher(kernel)
    assert not launcher.direct_capable
    x, out = fresh(40), torch.full((40,), float("nan"))
    for _ in range(2):
        launcher((3,), x, out, 40, 2.0, BLOCK=16, FLAG=False)
    assert torch.equal(out, x * 2.0) and launcher.direct_launches == 0


def descriptor(base: torch.Tensor, block: list[int], layout_dtype: str = "") -> object:
    """A TMA descriptor over base viewed as [rows, 64]: Triton's, or Gluon's with an NVMMA layout."""
    rows = base.numel() // 64
    if not layout_dtype:
        return TensorDescriptor(base, [rows, 64], [64, 1], block)
    gl = pytest.importorskip("triton.experimental.gluon.language")
    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    layout = gl.NVMMASharedLayout.get_default_for(block, getattr(gl, layout_dtype))
    return hopper.TensorDescriptor(base, [rows, 64], [64, 1], block, layout)


@pytest.mark.parametrize("gluon", [False, True])
def test_descriptors_over_other_memory_reuse_the_kept_kernel(recorded, gluon: bool) -> None:
    """A descriptor's base, shape and strides are encoded at each launch: a new cache of the same
    dtype, block shape and layout goes straight to the kept kernel, with the new descriptor."""
    launcher, dispatch = recorded
    layout_dtype = "bfloat16" if gluon else ""
    first = descriptor(fresh(64 * 64).bfloat16(), [16, 64], layout_dtype)
    launcher((1,), first, torch.empty(8), 8, 1.0, BLOCK=16, FLAG=True)
    other = descriptor(fresh(64 * 128).bfloat16(), [16, 64], layout_dtype)  # twice the rows
    launcher((1,), other, torch.empty(8), 8, 1.0, BLOCK=16, FLAG=True)
    assert len(dispatch.calls) == 1 and launcher.direct_launches == 1
    assert dispatch.compiled[0].runs[0][9] is other


@pytest.mark.parametrize("change", ["block shape", "dtype", "layout"])
def test_descriptor_fields_triton_specializes_on_compile_through_triton(recorded, change: str) -> None:
    launcher, dispatch = recorded
    gluon = change == "layout"
    base = fresh(64 * 64).bfloat16()
    out = torch.empty(8)
    launcher(
        (1,),
        descriptor(base, [16, 64], "bfloat16" if gluon else ""),
        out,
        8,
        1.0,
        BLOCK=16,
        FLAG=0,
    )
    if change == "block shape":
        changed = descriptor(base, [32, 64])
    elif change == "dtype":
        changed = descriptor(base.half(), [16, 64])
    elif change == "layout":  # the same block shape and dtype, a 64-byte swizzle, not 128
        kept = descriptor(base, [16, 64], "bfloat16")
        swizzle64 = type(kept.layout)(swizzle_byte_width=64, element_bitwidth=16, rank=2)
        changed = type(kept)(kept.base, kept.shape, kept.strides, kept.block_shape, swizzle64)
    launcher((1,), changed, out, 8, 1.0, BLOCK=16, FLAG=0)
    assert len(dispatch.calls) == 2 and launcher.direct_launches == 0


@pytest.mark.parametrize("value", ["tuple of tensors", "list", "unhashable constexpr"])
def test_values_the_key_cannot_describe_launch_through_triton_and_are_not_kept(recorded, value: str) -> None:
    """Every such launch goes through Triton (which specializes as it sees fit), and nothing is
    kept: neither a kernel that a later, different value could reach, nor the value itself."""
    launcher, dispatch = recorded
    out = torch.empty(8)
    for _ in range(3):
        x: object = (fresh(8), fresh(8)) if value == "tuple of tensors" else [fresh(8)]
        block: object = [16] if value == "unhashable constexpr" else 16
        if value == "unhashable constexpr":
            x = fresh(8)
        launcher((1,), x, out, 8, 1.0, BLOCK=block, FLAG=0)
    assert len(dispatch.calls) == 3 and launcher.direct_launches == 0 and not launcher._compiled

"""Host-to-device staging: the one utility the engine uses to move step inputs to the device,
and the host memory that device copies go through (a KV connector's CPU tier).

Pinned host memory makes `non_blocking` copies truly asynchronous; it only exists with CUDA, so on
a CPU-only machine buffers are plain and the "device" side may alias the host side.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


def _can_pin(pin_memory: bool) -> bool:
    return pin_memory and torch.cuda.is_available()


def host_empty(size: tuple[int, ...], dtype: torch.dtype, pin_memory: bool = True) -> torch.Tensor:
    """An uninitialized host tensor, pinned where CUDA exists, for copies to and from a device
    that do not block the host."""
    return torch.empty(size, dtype=dtype, device="cpu", pin_memory=_can_pin(pin_memory))


def async_tensor_h2d(
    data: list | torch.Tensor, dtype: torch.dtype, device: torch.device | str, pin_memory: bool
) -> torch.Tensor:
    """`data` as a `dtype` tensor on `device`, copied without blocking the host when pinned."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise ValueError(f"async_tensor_h2d stages host data, got a tensor on {data.device}")
        host = data.to(dtype)
        if _can_pin(pin_memory) and not host.is_pinned():
            host = host.pin_memory()
    else:
        host = torch.tensor(data, dtype=dtype, device="cpu", pin_memory=_can_pin(pin_memory))
    return host.to(device, non_blocking=True)


@contextlib.contextmanager
def host_single_threaded() -> Iterator[None]:
    """Run a step's host-side preparation (index arithmetic over a few thousand rows) on one
    thread. PyTorch spreads some of these small ops over the intra-op thread pool, and where the
    host's cores are busy the pool's barriers cost milliseconds an op: the H200 host spent ~3 ms
    on one repeat_interleave over 8192 rows with 16 threads, this 2-core VM under load 24 ms;
    one thread does each in tens of microseconds. The pool size is restored on exit; it is
    process-wide, so this is for the engine's one stepping thread, not for concurrent callers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class CpuGpuBuffer:
    """A host tensor and a device tensor of one shape; fill `.cpu`, then `copy_to_device(n)`."""

    def __init__(
        self, *size: int, dtype: torch.dtype, device: torch.device | str, pin_memory: bool = True
    ) -> None:
        self.device = torch.device(device)
        self.cpu = torch.zeros(size, dtype=dtype, device="cpu", pin_memory=_can_pin(pin_memory))
        self.gpu = (
            self.cpu if self.device.type == "cpu" else torch.zeros(size, dtype=dtype, device=self.device)
        )

    @property
    def np(self) -> np.ndarray:
        """The host tensor as a numpy array (a view: writes land in `.cpu`). A step's index
        arithmetic over a few rows costs ~1 us a numpy op against ~5-15 us a torch CPU op (its
        dispatch), which at batch 1 is most of a CUDA graph replay's host fill."""
        return self.cpu.numpy()

    def copy_to_device(self, n: int | None = None) -> torch.Tensor:
        """Copy the first `n` rows (all when None) and return that device view."""
        rows = self.cpu.shape[0] if n is None else n
        if not 0 <= rows <= self.cpu.shape[0]:
            raise ValueError(f"cannot copy {rows} rows of a buffer with {self.cpu.shape[0]}")
        if self.gpu is not self.cpu:
            self.gpu[:rows].copy_(self.cpu[:rows], non_blocking=True)
        else:  # `.np` writes bypass torch's version counter, which checks of a tensor key on
            torch.autograd.graph.increment_version(self.cpu)
        return self.gpu[:rows]


class CopyFence:
    """Pinned host buffers that each step rewrites, guarded: `wait()` before rewriting them
    returns once the copies out of them that the last `record()` followed have run. A step's
    non-blocking copies run when the device reaches them in its stream; while the engine ended
    every step in a read-back they had always run by the next step, but under async scheduling
    the host fills step N+1 while the device may still be on step N - 1, with step N's copies
    queued behind it: rewriting the buffers then would hand step N step N+1's inputs. The wait
    costs little: by the time N+1 is filled, step N - 1 was read back, so step N's copies are
    next in the stream. A no-op off CUDA (the copies are synchronous there)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.event: torch.cuda.Event | None = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def record(self) -> None:
        if self.device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()

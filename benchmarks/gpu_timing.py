"""Timing helpers the GPU benchmarks share."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def host_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Microseconds of host time per call of fn (no sync inside) while the GPU is kept busy, so
    that launches queue instead of waiting: the launch cost the GPU sees when it is idle.

    The median of the calls, each timed alone: once the driver's launch queue is full (about a
    thousand launches; a call that launches several kernels fills it within 200 calls) a launch
    blocks until the GPU drains it, here until the sleep ends, and a mean over the calls would
    report that wait as host time."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU cycles: longer than the calls take
    each = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        each.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(each) * 1e6

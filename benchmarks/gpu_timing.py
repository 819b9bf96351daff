"""Timing helpers the GPU benchmarks share."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def host_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Microseconds of host time per call of fn (no sync inside) while the GPU is kept busy, so
    that launches queue instead of waiting: the launch cost the GPU sees when it is idle."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU cycles: longer than the calls take
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6

"""The intra-op thread count of CPU steps: measured once at start-up, then fixed for the engine's life.

Why measure: every parallel region of a step (a weight product, the attention kernel, a gather)
ends in a barrier that waits for all of the pool's threads. Where other processes share the
cores, one pool thread is often descheduled and the barrier waits for the OS to run it again:
on the 2-core VM under a load of 3-5, SmolLM2-135M float32 decode steps took 450-600 ms at 2
threads and ~100 ms at 1 (benchmarks/RESULTS.md, cpu-load-s34); on a quiet host the full pool
is the faster one. Neither is known before steps run.

Why only once: a float32 sum split over more threads adds in another order, so a count that
followed the momentary load would let two runs of one request differ. The engine's warm-up times
decode steps at each candidate (torch's pool size, then halvings down to 1), in interleaved
rounds so that a load spike hits every candidate alike, and every later step runs at the
fastest (`engine.cpu_threads = "auto"`); an integer pins the count and nothing is measured.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

ROUNDS = 3  # timed decode steps per candidate (their median decides); one untimed round before


def thread_candidates(threads: int) -> tuple[int, ...]:
    """`threads`, then halvings down to 1: (16, 8, 4, 2, 1), (6, 3, 1), (1,)."""
    out = [max(threads, 1)]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return tuple(out)


@dataclass
class CpuThreads:
    """The thread count of a CPU engine's steps (`threads`), and how it was chosen: `pinned` by the
    config, else the median decode step time of each candidate (`timings_s`) measured at warm-up."""

    threads: int
    candidates: tuple[int, ...]
    pinned: bool
    timings_s: dict[int, list[float]] = field(default_factory=dict)

    @classmethod
    def from_config(cls, setting: int | str) -> CpuThreads:
        """"auto": torch's pool size until `choose` ran; an integer: that count, never measured."""
        if isinstance(setting, int):
            return cls(setting, (setting,), pinned=True)
        candidates = thread_candidates(torch.get_num_threads())
        return cls(candidates[0], candidates, pinned=False)

    @property
    def needs_measuring(self) -> bool:
        return len(self.candidates) > 1 and not self.timings_s

    def record(self, threads: int, seconds: float) -> None:
        self.timings_s.setdefault(threads, []).append(seconds)

    def choose(self) -> int:
        """Fixes `threads` at the candidate of the lowest median step time (the larger count on a
        tie); with nothing timed (no decode step could run), at the pool's size."""
        if not self.timings_s:
            self.threads = self.candidates[0]
            return self.threads
        medians = {c: statistics.median(t) for c, t in self.timings_s.items()}
        self.threads = min(medians, key=lambda c: (medians[c], -c))
        return self.threads

    def summary(self) -> dict[str, object]:
        """For `jackfield run` and benchmarks: the count, where it came from (the config, the
        timings, or torch's pool size when there was nothing to choose or time) and the median
        decode step ms per candidate timed."""
        source = "measured" if self.timings_s else "torch's pool size"
        source = "engine.cpu_threads" if self.pinned else source
        medians = {c: round(statistics.median(t) * 1e3, 2) for c, t in self.timings_s.items()}
        return {"threads": self.threads, "source": source, "decode_step_ms": medians}

    @contextlib.contextmanager
    def run_at(self, threads: int | None = None) -> Iterator[None]:
        """The body at `threads` (default: the chosen count), torch's pool size restored after."""
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads if threads is None else threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

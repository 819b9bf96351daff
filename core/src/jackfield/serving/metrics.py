"""What `/metrics` reports, in the Prometheus text format: counters, gauges and the histograms of
time to first token and inter-token latency, as clients see them from the server."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Seconds; the upper bounds vLLM uses for the same two histograms, trimmed at both ends.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


@dataclass
class Histogram:
    """A cumulative Prometheus histogram over fixed upper bounds (+Inf implied)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bound, not cumulative; the last is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, n in zip((*map(repr, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        return out + [f"{name}_sum {self.total!r}", f"{name}_count {self.count}"]


@dataclass
class ServerMetrics:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS_S))

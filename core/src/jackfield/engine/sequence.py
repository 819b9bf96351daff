"""A request as the engine tracks it: tokens, progress, blocks, timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from jackfield.contracts.sampler import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # admitted, its prefix's KV coming from a KV connector
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpeculativeStats:
    """Speculative decoding of one request (or, summed, of a run)."""

    drafts: int = 0  # verify steps with at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: drafts whose token j was accepted

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step: 1 + accepted / drafts (1.0 when nothing was drafted)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += num_drafted
        self.accepted_tokens += num_accepted
        grow = num_drafted - len(self.accepted_per_position)
        self.accepted_per_position += [0] * max(grow, 0)
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def add(self, other: SpeculativeStats) -> None:
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        grow = len(other.accepted_per_position) - len(self.accepted_per_position)
        self.accepted_per_position += [0] * max(grow, 0)
        for j, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[j] += count

    def as_dict(self) -> dict[str, object]:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position),
                "mean_acceptance_length": round(self.mean_acceptance_length, 4)}


@dataclass(eq=False)  # identity: the scheduler's lists hold each request once
class Sequence:
    """`token_ids` is prompt + generated so far. `num_computed` tokens have their KV in the cache
    (after a preemption it drops to 0 and everything is recomputed, generated tokens included).
    Under async scheduling a decode step's token is `in flight` from its launch until the engine
    reads it back a step later: `num_computed` already counts the step's position (its KV is
    being written), `token_ids` does not yet hold the token."""

    request_id: int
    prompt_len: int
    token_ids: list[int]
    params: SamplingParams
    seed: int
    pooling: str | None = None  # an embedding request: its rows pooled so ("mean", "last", "cls"), no tokens
    status: Status = Status.WAITING
    num_computed: int = 0
    block_tables: list[list[int]] = field(default_factory=list)  # one per KV cache group; [] when none held
    table_row: int | None = None  # its row of the block manager's BlockTableRows, while it holds one
    state_slot: int | None = None  # a hybrid model's recurrent state slot, held with the blocks
    num_cached_prefix: int = 0  # tokens served by the prefix cache on the first admission
    num_loading: int = 0  # tokens past num_computed whose KV a connector is loading
    num_preemptions: int = 0
    num_in_flight: int = 0  # sampled tokens launched but not read back yet (async scheduling)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: one entry per prompt token (None for the first), filled by prefill
    prompt_logprobs: list[dict[int, float] | None] | None = None
    text_end: int | None = None  # where a stop string begins in the decoded output (text is cut there)
    draft_ids: list[int] = field(default_factory=list)  # proposed after token_ids, verified next step
    # float32 [len(draft_ids), vocab]: the distribution each draft was drawn from (None: certain drafts)
    draft_probs: torch.Tensor | None = None
    speculative: SpeculativeStats = field(default_factory=lambda: SpeculativeStats())
    embedding: torch.Tensor | None = None  # an embedding request's pooled vector [hidden] float32
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether cached prefix blocks may stand in for computing the prompt: not for a request
        that needs every prompt row's output (pooling runs whole; prompt logprobs read each row)."""
        return self.pooling is None and self.params.prompt_logprobs is None

    @property
    def block_table(self) -> list[int]:
        """The first KV cache group's table (the only one unless the model has sliding windows)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_tokens_ahead(self) -> int:
        """Known tokens and those in flight: the position after the newest launched token."""
        return len(self.token_ids) + self.num_in_flight

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens_ahead - self.num_computed

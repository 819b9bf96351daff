"""The speculative-decoding drafter contract and the one lookahead rule connectors use."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftProposal:
    """Draft tokens per request: token_ids[i] has at most num_speculative_tokens entries."""

    token_ids: list[list[int]]


@dataclass(frozen=True)
class DrafterOptions:
    """What a drafter is built from (the config's [speculative] table): the engine calls a
    registered drafter's factory with one of these."""

    num_speculative_tokens: int
    prompt_lookup_min: int = 5  # n-gram lookup: shortest and longest suffix matched
    prompt_lookup_max: int = 5
    model: str | None = None  # a draft checkpoint directory, for drafters with their own weights


class Drafter(ABC):
    """Proposes up to `num_speculative_tokens` tokens per request for the target to verify."""

    name: str

    def __init__(self, options: DrafterOptions) -> None:
        if options.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {options.num_speculative_tokens}")
        self.options = options

    @property
    def num_speculative_tokens(self) -> int:
        return self.options.num_speculative_tokens

    @property
    def lookahead_tokens(self) -> int:
        """KV slots past the last verified token that drafting may write.

        The default is one slot per speculative token. A parallel drafter that writes a whole
        block (DFlash-style) or keeps extra mask slots overrides this.
        """
        return self.num_speculative_tokens

    @abstractmethod
    def propose(
        self,
        token_ids: Sequence[Sequence[int]],
        hidden_states: torch.Tensor | None = None,
    ) -> DraftProposal:
        """Draft tokens after each request's verified `token_ids`."""


def combined_lookahead(drafters: Iterable[Drafter]) -> int:
    """The KV slots a step may write past the verified tokens, over every active drafter."""
    return max((d.lookahead_tokens for d in drafters), default=0)


def exportable_tokens(num_computed_tokens: int, lookahead_tokens: int, num_verified_tokens: int) -> int:
    """How many of a request's KV tokens a connector may export: the verified ones only.

    Draft KV past the verified tokens is never exported. `num_computed_tokens` may include up
    to `lookahead_tokens` unverified slots; the result backs off to the verified count.
    """
    if lookahead_tokens < 0 or num_verified_tokens < 0 or num_computed_tokens < 0:
        raise ValueError("token counts must be >= 0")
    if num_computed_tokens - num_verified_tokens > lookahead_tokens:
        raise ValueError(
            f"{num_computed_tokens - num_verified_tokens} unverified tokens exceed the "
            f"lookahead of {lookahead_tokens}"
        )
    return min(num_computed_tokens, num_verified_tokens)

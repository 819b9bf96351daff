"""The sampler contract: logits + per-row metadata -> token ids (+ logprobs)."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (the vLLM names and meanings).

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1 and min_p 0 disable those filters.
    seed None: the engine draws one from its seeded generator and reports it in the output.
    logprobs k: the top-k logprobs of each generated token's distribution are returned.
    logit_bias {token id: bias} is added to the logits; allowed_token_ids restricts sampling to
    those tokens (both before temperature, filters and greedy argmax).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        errors = []
        if not (0.0 <= self.temperature < math.inf):
            errors.append(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < -1:
            errors.append(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            errors.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            errors.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            errors.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            errors.append(f"logprobs must be >= 0, got {self.logprobs}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            errors.append(f"seed must be in [0, 2**63), got {self.seed}")
        if self.logit_bias is not None:
            if any(int(t) < 0 for t in self.logit_bias):
                errors.append("logit_bias token ids must be >= 0")
            if not all(math.isfinite(float(b)) for b in self.logit_bias.values()):
                errors.append("logit_bias values must be finite")
        if self.allowed_token_ids is not None:
            if len(self.allowed_token_ids) == 0:
                errors.append("allowed_token_ids must name at least one token (None: all allowed)")
            if any(int(t) < 0 for t in self.allowed_token_ids):
                errors.append("allowed_token_ids must be >= 0")
        if errors:
            raise ValueError("invalid SamplingParams: " + "; ".join(errors))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in self.allowed_token_ids))


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row tensors for one step, on the logits' device. Row i samples one token.

    temperature float32 [R]; top_k int64 [R] (0 = off); top_p, min_p float32 [R];
    seeds int64 [R]; positions int64 [R] (the position of the token being sampled);
    drafting bool: True when a drafter samples (uses a disjoint noise stream).
    max_num_logprobs: largest k asked by any row (None: no logprobs).
    logit_bias float32 [R, V]: added to the logits (None: no row has a bias).
    allowed_token_mask bool [R, V]: False tokens are never sampled (None: all allowed).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    drafting: bool = False
    max_num_logprobs: int | None = None
    logit_bias: torch.Tensor | None = None
    allowed_token_mask: torch.Tensor | None = None



@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [R]
    logprob_token_ids: torch.Tensor | None = None  # int64 [R, k]
    logprobs: torch.Tensor | None = None  # float32 [R, k] (log-softmax of the raw logits)
    invalid_rows: torch.Tensor | None = None  # bool [R]: the row had no finite logit


class Sampler(ABC):
    """Turns one step's logits into tokens. Must be deterministic given the metadata."""

    name: str

    @abstractmethod
    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput: ...

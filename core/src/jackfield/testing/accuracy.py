"""Logprob errors of a low-precision run against a float32 reference, at every prompt position:
what the bf16 accuracy tests and benchmarks/accuracy_e2e.py measure (benchmarks/notes_accuracy.md).

At a position, the error is the max |logprob - reference logprob| over the run's own 5 most
likely tokens. A random MoE model has routing knife-edges (a rounding flips an expert choice and
moves a position's logprobs by ~0.3-2), so a median over the many positions of a few prompts
is the stable figure; one position per prompt (the first generated token) is a noisy one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from torch import nn


class ScoredOutput(Protocol):
    """What the errors read of an engine's output (a RequestOutput generated with logprobs=5
    and prompt_logprobs=5): entry p + 1 of prompt_logprobs is position p's top 5 (entry 0 is
    None), logprobs[0] the first generated token's, at the prompt's last position."""

    @property
    def prompt_logprobs(self) -> Sequence[Mapping[int, float] | None] | None: ...

    @property
    def logprobs(self) -> Sequence[Mapping[int, float]] | None: ...


def top5_error(top: Mapping[int, float], want: torch.Tensor) -> float:
    """max |logprob - want[token]| over the 5 most likely tokens of `top` (an engine's top 5,
    perhaps with one more token: the sampled or the scored one); want [V]."""
    best = sorted(top.items(), key=lambda item: item[1], reverse=True)[:5]
    return max(abs(value - want[token].item()) for token, value in best)


def engine_errors(outputs: Sequence[ScoredOutput], want: torch.Tensor) -> torch.Tensor:
    """[B, S] errors of the engine's outputs (one per prompt of S tokens) against the reference's
    logprobs want [B, S, V]."""
    errors = torch.empty(want.shape[:2])
    for i, out in enumerate(outputs):
        if out.prompt_logprobs is None or out.logprobs is None:
            raise ValueError("engine_errors reads outputs generated with prompt_logprobs and logprobs")
        row = []
        for p, top in enumerate([*out.prompt_logprobs[1:], out.logprobs[0]]):
            if top is None:
                raise ValueError(f"output {i} has no logprobs at position {p}")
            row.append(top5_error(top, want[i, p]))
        errors[i] = torch.tensor(row)
    return errors


def own_top5_errors(theirs: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Errors of logprobs theirs [..., V] against want [..., V] over theirs' own top 5."""
    top = theirs.topk(5, dim=-1).indices
    return (theirs.gather(-1, top) - want.gather(-1, top)).abs().amax(-1)


def every_position_logprobs(model: nn.Module, prompts: torch.Tensor) -> torch.Tensor:
    """log_softmax of a transformers model's logits at every position of prompts [B, S] (on the
    model's device): [B, S, V] float32 on the CPU."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(prompts.to(device)).logits
        return torch.log_softmax(logits.float(), dim=-1).cpu()

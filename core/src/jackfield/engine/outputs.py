"""What `LLM.generate` returns, one per prompt, in prompt order."""

from __future__ import annotations

from dataclasses import dataclass

from jackfield.engine.sequence import SpeculativeStats


@dataclass(frozen=True)
class RequestTimings:
    time_to_first_token_s: float
    total_s: float  # arrival to finish


@dataclass(frozen=True)
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated
    text: str | None  # None when the model directory has no tokenizer
    finish_reason: str  # "stop" (EOS or a stop token) | "length" (max_tokens or max_model_len)
    seed: int  # the sampling seed used (drawn from the engine's generator when none was given)
    logprobs: list[dict[int, float]] | None  # per generated token: top-k token id -> logprob
    timings: RequestTimings
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    num_preemptions: int
    speculative: SpeculativeStats | None = None  # drafts and acceptance (None: no speculative decoding)

"""What `LLM.generate` returns, one per prompt, in prompt order (vLLM's shape: a RequestOutput
holds one CompletionOutput per sample)."""

from __future__ import annotations

from dataclasses import dataclass

from jackfield.engine.sequence import SpeculativeStats


@dataclass(frozen=True)
class RequestTimings:
    time_to_first_token_s: float  # arrival to the first token of any sample
    total_s: float  # arrival to the last sample's finish


@dataclass(frozen=True)
class CompletionOutput:
    """One sample of a prompt (SamplingParams.n gives n of them)."""

    index: int
    token_ids: list[int]  # generated
    text: str | None  # None when the model directory has no tokenizer
    finish_reason: str  # "stop" (EOS, a stop token or string) | "length" (max_tokens or max_model_len)
    seed: int  # the sampling seed used (drawn from the engine's generator when none was given)
    logprobs: list[dict[int, float]] | None  # per generated token: top-k token id -> logprob, and its own
    speculative: SpeculativeStats | None = None  # drafts and acceptance (None: no speculative decoding)


@dataclass(frozen=True)
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # per prompt token: None for the first, then its own logprob and the top-k given the tokens before
    prompt_logprobs: list[dict[int, float] | None] | None
    timings: RequestTimings
    num_cached_tokens: int  # prompt tokens served by the prefix cache (the first sample's)
    num_preemptions: int  # over every sample

    # The first sample's fields, for the common n = 1 case.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def seed(self) -> int:
        return self.outputs[0].seed

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs

    @property
    def speculative(self) -> SpeculativeStats | None:
        return self.outputs[0].speculative

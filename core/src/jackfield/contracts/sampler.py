"""The sampler contract: logits + per-row metadata -> token ids (+ logprobs)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (the vLLM names and meanings).

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1 and min_p 0 disable those filters.
    seed None: the engine draws one from its seeded generator and reports it in the output.
    logprobs k: the top-k logprobs of each generated token's distribution are returned.
    stop: strings that end the output when its text contains one (the text is cut before it; the
    tokens up to the one that completed it are kept), as vLLM's `stop`.
    logit_bias {token id: bias} is added to the logits; allowed_token_ids restricts sampling to
    those tokens (both before temperature, filters and greedy argmax).
    n: independent samples of the prompt (vLLM's parallel sampling: `per_sample()`).
    presence_penalty, frequency_penalty (in [-2, 2], OpenAI's: subtracted once per token generated
    so far / once per occurrence) and repetition_penalty (> 0; a token in the prompt or the output
    has a positive logit divided by it, a negative one multiplied) after bias and allowed tokens.
    prompt_logprobs k: each prompt token's logprob (and the top k) given the tokens before it.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # text that ends the output (not included in it), across token boundaries
    logprobs: int | None = None
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        """Strict types (True is not an int, 2.5 is not an integer, floats are finite), then ranges;
        every problem at once, each naming its field. Values are stored as plain int/float/tuple."""
        errors: list[str] = []
        temperature, top_p, min_p, presence, frequency, repetition = (
            self._number(name, errors) for name in ("temperature", "top_p", "min_p", "presence_penalty",
                                                    "frequency_penalty", "repetition_penalty"))
        top_k, max_tokens, n = (self._integer(name, errors) for name in ("top_k", "max_tokens", "n"))
        seed = self._integer("seed", errors, optional=True)
        logprobs = self._integer("logprobs", errors, optional=True)
        prompt_logprobs = self._integer("prompt_logprobs", errors, optional=True)
        self._token_ids("stop_token_ids", errors)
        self._stop_strings(errors)
        allowed = self._token_ids("allowed_token_ids", errors, optional=True)
        if not isinstance(self.ignore_eos, bool):
            errors.append(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        self._logit_bias(errors)
        checks = [
            (temperature is None or temperature >= 0.0, f"temperature must be >= 0, got {temperature}"),
            (top_k is None or top_k >= -1, f"top_k must be -1, 0 (off) or positive, got {top_k}"),
            (top_p is None or 0.0 < top_p <= 1.0, f"top_p must be in (0, 1], got {top_p}"),
            (min_p is None or 0.0 <= min_p <= 1.0, f"min_p must be in [0, 1], got {min_p}"),
            (max_tokens is None or max_tokens >= 1, f"max_tokens must be >= 1, got {max_tokens}"),
            (logprobs is None or logprobs >= 0, f"logprobs must be >= 0, got {logprobs}"),
            (prompt_logprobs is None or prompt_logprobs >= 0,
             f"prompt_logprobs must be >= 0, got {prompt_logprobs}"),
            (n is None or n >= 1, f"n must be >= 1, got {n}"),
            (presence is None or -2.0 <= presence <= 2.0,
             f"presence_penalty must be in [-2, 2], got {presence}"),
            (frequency is None or -2.0 <= frequency <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {frequency}"),
            (repetition is None or repetition > 0.0, f"repetition_penalty must be > 0, got {repetition}"),
            (seed is None or 0 <= seed < 2**63, f"seed must be in [0, 2**63), got {seed}"),
            (allowed is None or len(allowed) > 0,
             "allowed_token_ids must name at least one token (None: all allowed)"),
        ]
        errors += [message for ok, message in checks if not ok]
        if errors:
            raise ValueError("invalid SamplingParams: " + "; ".join(errors))

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def per_sample(self) -> list[SamplingParams]:
        """The n single-sample requests this one stands for: n = 1 each; a seeded request's sample
        i gets seed + i (as vLLM), so the samples differ yet each is reproducible."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None else (self.seed + i) % 2**63)
                for i in range(self.n)]

    def _number(self, name: str, errors: list[str]) -> float | None:
        value = getattr(self, name)
        if not _is_real(value) or not math.isfinite(value):
            errors.append(f"{name} must be a finite number, got {value!r}")
            return None
        object.__setattr__(self, name, float(value))
        return float(value)

    def _integer(self, name: str, errors: list[str], optional: bool = False) -> int | None:
        value = getattr(self, name)
        if value is None and optional:
            return None
        if not _is_integer(value):
            errors.append(f"{name} must be an integer{' or None' if optional else ''}, got {value!r}")
            return None
        object.__setattr__(self, name, int(value))
        return int(value)

    def _token_ids(self, name: str, errors: list[str], optional: bool = False) -> tuple[int, ...] | None:
        value = getattr(self, name)
        if value is None and optional:
            return None
        if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
            errors.append(f"{name} must be a sequence of token ids, got {value!r}")
            return None
        items = tuple(value)
        bad = [t for t in items if not _is_integer(t) or t < 0]
        if bad:
            errors.append(f"{name} must hold token ids (integers >= 0), got {bad[:8]!r}")
            return None
        object.__setattr__(self, name, tuple(int(t) for t in items))
        return getattr(self, name)

    def _stop_strings(self, errors: list[str]) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
            errors.append(f"stop must be a non-empty string or a sequence of them, got {self.stop!r}")
            return
        object.__setattr__(self, "stop", tuple(stop))

    def _logit_bias(self, errors: list[str]) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, Mapping):
            errors.append(f"logit_bias must be a mapping {{token id: bias}}, got {bias!r}")
            return
        bad_ids = [t for t in bias if not _is_integer(t) or t < 0]
        # The bias is added to float32 logits: a value float32 cannot hold would become inf there.
        bad_values = [v for v in bias.values() if not _is_real(v) or not abs(v) <= FLOAT32_MAX]
        if bad_ids:
            errors.append(f"logit_bias keys must be token ids (integers >= 0), got {bad_ids[:8]!r}")
        if bad_values:
            errors.append("logit_bias values must be finite numbers within float32 "
                          f"(|bias| <= {FLOAT32_MAX:.4g}), got {bad_values[:8]!r}")
        if not bad_ids and not bad_values:
            object.__setattr__(self, "logit_bias", {int(t): float(v) for t, v in bias.items()})


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _is_integer(value: object) -> bool:
    """An int (numpy's too), never a bool and never a float that happens to be whole."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class Penalties:
    """What vLLM's presence, frequency and repetition penalties need, per row of the step.

    presence, frequency, repetition float32 [R] (0, 0, 1: off); output_counts int32 [R, V]: how
    often each token was generated so far; in_prompt bool [R, V]: the token occurs in the prompt.
    """

    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    output_counts: torch.Tensor
    in_prompt: torch.Tensor


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row tensors for one step, on the logits' device. Row i samples one token.

    temperature float32 [R]; top_k int64 [R] (0 = off); top_p, min_p float32 [R] (None: that
    filter is off for every row; all three None: temperature-only draws, which need no device sync
    to find the rows that filter); seeds int64 [R]; positions int64 [R] (the position of the token
    being sampled);
    drafting bool: True when a drafter samples (uses a disjoint noise stream).
    max_num_logprobs: largest k asked by any row (None: no logprobs).
    logit_bias float32 [R, V]: added to the logits (None: no row has a bias).
    allowed_token_mask bool [R, V]: False tokens are never sampled (None: all allowed).
    penalties: presence/frequency/repetition penalties (None: no row has one).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    seeds: torch.Tensor
    positions: torch.Tensor
    drafting: bool = False
    max_num_logprobs: int | None = None
    logit_bias: torch.Tensor | None = None
    allowed_token_mask: torch.Tensor | None = None
    penalties: Penalties | None = None


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [R]
    logprob_token_ids: torch.Tensor | None = None  # int64 [R, k]
    logprobs: torch.Tensor | None = None  # float32 [R, k] (log-softmax of the raw logits)
    invalid_rows: torch.Tensor | None = None  # bool [R]: the row had no finite logit


class Sampler(ABC):
    """Turns one step's logits into tokens. Must be deterministic given the metadata."""

    name: str
    # sample() of metadata without filters, logprobs, bias, mask or penalties launches device work
    # only (no host sync, no Python branch on device values), so the engine may record it in a
    # CUDA graph (a drafter's chain of drafts)
    records_plain_draws: bool = False

    @abstractmethod
    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput: ...

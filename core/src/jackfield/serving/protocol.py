"""OpenAI request fields -> SamplingParams (vLLM's names and defaults), and the error they raise.

Every field is known: the ones mapped to SamplingParams, the ones that change nothing here
(`user`, `metadata`, ...), and the ones refused by name with a 400 because they would change the
output and are not implemented. An unknown field is a 400 too, never silently ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from jackfield.contracts.sampler import SamplingParams


class RequestError(ValueError):
    """A bad request: HTTP `status`, OpenAI-style body naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status

    def body(self) -> dict[str, object]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.status}}


# field: (the value that changes nothing, why it is refused otherwise)
UNSUPPORTED = {
    "best_of": (None, "best_of is not supported"),
    "echo": (False, "echo is not supported yet"),
    "suffix": (None, "suffix is not supported"),
    "tools": (None, "tools are not supported"),
    "tool_choice": (None, "tool_choice is not supported"),
    "response_format": (None, "response_format is not supported"),
    "min_tokens": (0, "min_tokens is not supported yet"),
    "use_beam_search": (False, "beam search is not supported"),
    "guided_json": (None, "guided decoding is not supported"),
    "guided_regex": (None, "guided decoding is not supported"),
    "guided_choice": (None, "guided decoding is not supported"),
}
SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "stop_token_ids",
                   "ignore_eos", "logit_bias", "n", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logprobs", "prompt_logprobs", "stream", "stream_options"}
REQUEST_FIELDS = {"completions": {"model", "prompt"}, "chat": {"model", "messages", "max_completion_tokens",
                                                               "top_logprobs"}}
# Fields that cannot change what is generated here; accepted and ignored (as OpenAI and vLLM do).
NO_EFFECT_FIELDS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options",
                    "skip_special_tokens", "spaces_between_special_tokens", "priority", "request_id"}


@dataclass(frozen=True)
class GenerationRequest:
    params: SamplingParams  # stop strings included: the engine finds them
    stream: bool
    include_usage: bool


def parse_generation(
    body: Mapping[str, object], *, default_max_tokens: int | None, max_room: int, chat: bool
) -> GenerationRequest:
    """Sampling fields of a completions or chat request. `default_max_tokens` None: as many as the
    context leaves (`max_room`), as vLLM does for chat."""
    known = SAMPLING_FIELDS | REQUEST_FIELDS["chat" if chat else "completions"] | NO_EFFECT_FIELDS
    for name in body:
        if name in UNSUPPORTED:
            neutral, why = UNSUPPORTED[name]
            if body[name] is not None and body[name] != neutral:
                raise RequestError(why, name)
        elif name not in known:
            raise RequestError(f"unknown field {name!r}", name)
    logprobs = _logprobs(body, chat)
    max_key = (
        "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    )
    max_tokens = body.get(max_key, None)
    if max_tokens is None:
        max_tokens = default_max_tokens if default_max_tokens is not None else max_room
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise RequestError("stream_options must be an object", "stream_options")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be a boolean, got {stream!r}", "stream")
    bias = body.get("logit_bias")
    try:
        params = SamplingParams(
            temperature=_get(body, "temperature", 1.0),
            top_p=_get(body, "top_p", 1.0),
            top_k=_get(body, "top_k", 0),
            min_p=_get(body, "min_p", 0.0),
            seed=body.get("seed"),
            max_tokens=max_tokens,
            stop_token_ids=tuple(body.get("stop_token_ids") or ()),
            stop=body.get("stop") or (),
            ignore_eos=_get(body, "ignore_eos", False),
            logit_bias=_token_keys(bias) if isinstance(bias, Mapping) else bias,
            n=_get(body, "n", 1),
            presence_penalty=_get(body, "presence_penalty", 0.0),
            frequency_penalty=_get(body, "frequency_penalty", 0.0),
            repetition_penalty=_get(body, "repetition_penalty", 1.0),
            logprobs=logprobs,
            prompt_logprobs=body.get("prompt_logprobs"),
        )
    except (ValueError, TypeError) as exc:
        raise RequestError(str(exc), field_named(str(exc))) from None
    return GenerationRequest(params, stream, bool(options.get("include_usage", False)))


MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs (completions' logprobs allow 5; vLLM allows 20)


def _logprobs(body: Mapping[str, object], chat: bool) -> int | None:
    """SamplingParams.logprobs: completions' `logprobs` k, or chat's `logprobs` true with
    `top_logprobs` k (0 when absent)."""
    if chat:
        wanted, top = body.get("logprobs"), body.get("top_logprobs")
        if wanted not in (None, True, False):
            raise RequestError(f"logprobs must be a boolean, got {wanted!r}", "logprobs")
        if top is not None and not wanted:
            raise RequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        k, name = (top if top is not None else 0, "top_logprobs") if wanted else (None, "logprobs")
    else:
        k, name = body.get("logprobs"), "logprobs"
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS):
        raise RequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}", name)
    return k


def _get(body: Mapping[str, object], name: str, default: object) -> object:
    value = body.get(name)
    return default if value is None else value


def _token_keys(bias: Mapping[object, object]) -> dict[object, object]:
    """OpenAI's logit_bias keys are token ids as JSON strings."""
    return {int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: v for k, v in bias.items()}


def field_named(message: str) -> str | None:
    """The first request field a validation message names (SamplingParams starts each problem
    with its field's name)."""
    found = [(m.start(), name) for name in SAMPLING_FIELDS if (m := re.search(rf"\b{name}\b", message))]
    return min(found)[1] if found else None

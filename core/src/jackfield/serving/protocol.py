"""OpenAI request fields -> SamplingParams (vLLM's names and defaults), and the error they raise.

Fields that would change the output and are not implemented yet are refused by name (a 400),
never ignored; fields that do not affect the output (user, metadata, ...) are accepted.
"""

from __future__ import annotations

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
    "n": (1, "n > 1 (several choices per prompt) is not supported yet"),
    "best_of": (None, "best_of is not supported"),
    "echo": (False, "echo is not supported yet"),
    "presence_penalty": (0, "presence_penalty is not supported yet"),
    "frequency_penalty": (0, "frequency_penalty is not supported yet"),
    "repetition_penalty": (1, "repetition_penalty is not supported yet"),
    "logprobs": (None, "logprobs are not supported by the server yet"),
    "top_logprobs": (None, "top_logprobs are not supported by the server yet"),
    "suffix": (None, "suffix is not supported"),
    "tools": (None, "tools are not supported"),
    "response_format": (None, "response_format is not supported"),
}


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
    for name, (neutral, why) in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != neutral and not (name == "logprobs" and chat and value is False):
            raise RequestError(why, name)
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
        )
    except (ValueError, TypeError) as exc:
        raise RequestError(str(exc), field_named(str(exc))) from None
    return GenerationRequest(params, stream, bool(options.get("include_usage", False)))


def _get(body: Mapping[str, object], name: str, default: object) -> object:
    value = body.get(name)
    return default if value is None else value


def _token_keys(bias: Mapping[object, object]) -> dict[object, object]:
    """OpenAI's logit_bias keys are token ids as JSON strings."""
    return {int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: v for k, v in bias.items()}


def field_named(message: str) -> str | None:
    """The first SamplingParams field a validation message names (it starts each problem with it)."""
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "max_tokens",
        "stop_token_ids",
        "stop",  # after stop_token_ids, which contains it
        "ignore_eos",
        "logit_bias",
    ):
        if name in message:
            return name
    return None

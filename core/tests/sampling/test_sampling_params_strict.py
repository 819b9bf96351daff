"""SamplingParams takes exactly the values it can run: strict types, finite floats, float32 biases.

The references are Python's own types and torch's float32 conversion, not the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jackfield.contracts.sampler import SamplingParams

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)

INT_FIELDS = ("top_k", "max_tokens", "seed", "logprobs")
FLOAT_FIELDS = ("temperature", "top_p", "min_p")

# Values that are not integers, whatever they look like: bools, whole and fractional floats,
# numeric strings, containers.
NOT_INTEGERS = st.one_of(
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(alphabet="0123456789.", min_size=1, max_size=4),
    st.lists(st.integers(0, 9), max_size=2),
)


def error_of(**kwargs: object) -> str:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    return str(info.value)


@SETTINGS
@given(field=st.sampled_from(INT_FIELDS), value=NOT_INTEGERS)
def test_integer_fields_take_only_integers(field: str, value: object) -> None:
    assert f"{field} must be an integer" in error_of(**{field: value})


@SETTINGS
@given(top_k=st.integers(-1, 2**40), max_tokens=st.integers(1, 2**40), seed=st.integers(0, 2**63 - 1),
       logprobs=st.integers(0, 2**20), numpy_ints=st.booleans())
def test_integers_in_range_are_kept_as_python_ints(top_k: int, max_tokens: int, seed: int, logprobs: int,
                                                   numpy_ints: bool) -> None:
    wrap = np.int64 if numpy_ints else int
    params = SamplingParams(top_k=wrap(top_k), max_tokens=wrap(max_tokens), seed=wrap(seed),
                            logprobs=wrap(logprobs))
    expected_values = {"top_k": top_k, "max_tokens": max_tokens, "seed": seed, "logprobs": logprobs}
    for field, expected in expected_values.items():
        value = getattr(params, field)
        assert type(value) is int and value == expected


@SETTINGS
@given(field=st.sampled_from(FLOAT_FIELDS),
       value=st.one_of(st.sampled_from([math.nan, math.inf, -math.inf]), st.booleans(), st.text(max_size=3),
                       st.none()))
def test_float_fields_take_only_finite_numbers(field: str, value: object) -> None:
    assert f"{field} must be a finite number" in error_of(**{field: value})


@SETTINGS
@given(temperature=st.floats(0, 1e6), top_p=st.floats(0, 1, exclude_min=True), min_p=st.floats(0, 1))
def test_finite_floats_in_range_are_accepted_as_floats(temperature: float, top_p: float,
                                                       min_p: float) -> None:
    params = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p)
    assert (params.temperature, params.top_p, params.min_p) == (temperature, top_p, min_p)
    assert all(type(v) is float for v in (params.temperature, params.top_p, params.min_p))


@SETTINGS
@given(bias=st.floats(allow_nan=True, allow_infinity=True), token=st.integers(0, 2**31))
def test_logit_bias_is_accepted_exactly_when_float32_holds_it_finitely(bias: float, token: int) -> None:
    """Reference: what torch makes of the value as a float32 (the logits' dtype where it is added)."""
    fits = bool(torch.isfinite(torch.tensor(bias, dtype=torch.float64).to(torch.float32)))
    if fits and abs(bias) <= float(torch.finfo(torch.float32).max):
        assert SamplingParams(logit_bias={token: bias}).logit_bias == {token: bias}
    else:
        assert "logit_bias values must be finite numbers within float32" in error_of(logit_bias={token: bias})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logprobs": 2.5}, "logprobs must be an integer or None, got 2.5"),
        ({"max_tokens": True}, "max_tokens must be an integer, got True"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1"),
        ({"ignore_eos": "yes"}, "ignore_eos must be a bool"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a sequence of token ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids must be a sequence of token ids"),
        ({"stop_token_ids": [1, True, 2.0, -3]},
         "stop_token_ids must hold token ids (integers >= 0), got [True, 2.0, -3]"),
        ({"allowed_token_ids": (1.5,)}, "allowed_token_ids must hold token ids"),
        ({"logit_bias": {True: 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"7": 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {7: "1"}}, "logit_bias values must be finite numbers"),
        ({"logit_bias": [(7, 1.0)]}, "logit_bias must be a mapping"),
        ({"logit_bias": {7: 1e39}}, "logit_bias values must be finite numbers within float32"),
    ],
)
def test_each_error_names_its_field(kwargs: dict[str, object], message: str) -> None:
    assert message in error_of(**kwargs)


def test_every_problem_is_reported_at_once() -> None:
    text = error_of(temperature=math.nan, top_k=2.5, logprobs=True, ignore_eos=None)
    for field in ("temperature", "top_k", "logprobs", "ignore_eos"):
        assert field in text

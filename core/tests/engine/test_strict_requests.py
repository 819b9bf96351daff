"""Requests the engine cannot run are refused at the entry, naming the field, and leave it serving."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jackfield import LLM, SamplingParams
from jackfield.config import ConfigError

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
VOCAB = 256  # tests/models/checkpoints.py COMMON["vocab_size"]


@pytest.fixture(scope="module")
def llm(v3_dir) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(v3_dir, backend="torch_ref", block_size=16)


def prompt(seed: int, length: int = 6) -> list[int]:
    print(f"prompt seed {seed}")
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_still_serves(llm: LLM) -> None:
    assert not llm.engine.scheduler.has_work()
    out = llm.generate([prompt(0)], GREEDY)[0]
    assert len(out.token_ids) == 4


@settings(max_examples=25, deadline=None, derandomize=True)
@given(stop=st.lists(st.integers(0, 4 * VOCAB), min_size=1, max_size=4))
def test_stop_token_ids_must_be_in_the_vocabulary(llm: LLM, stop: list[int]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, stop_token_ids=stop)
    if all(t < VOCAB for t in stop):
        llm.generate([prompt(1)], params)
    else:
        with pytest.raises(ValueError, match=r"SamplingParams\.stop_token_ids: token ids .* outside the"):
            llm.generate([prompt(1), prompt(2)], [GREEDY, params])
        assert not llm.engine.scheduler.has_work()


@pytest.mark.parametrize("bad", [2.5, 3.0, True, "7", None])
def test_prompt_token_ids_must_be_integers(llm: LLM, bad: object) -> None:
    with pytest.raises(ValueError, match="prompt token ids must be integers"):
        llm.generate([[1, 2, bad]], GREEDY)  # type: ignore[list-item]
    assert_still_serves(llm)


def test_numpy_token_ids_are_integers(llm: LLM) -> None:
    ids = prompt(3)
    assert llm.generate([np.array(ids)], GREEDY)[0].token_ids == llm.generate([ids], GREEDY)[0].token_ids


def test_a_prompt_is_text_or_token_ids(llm: LLM) -> None:
    with pytest.raises(ValueError, match="a prompt is a string or a list of token ids, got float"):
        llm.generate([[1, 2], 4.5], GREEDY)  # type: ignore[list-item]
    assert_still_serves(llm)


def test_sampling_params_must_be_sampling_params(llm: LLM) -> None:
    with pytest.raises(ValueError, match="sampling params must be a SamplingParams, got dict"):
        llm.generate([[1, 2], [3, 4]], [GREEDY, {"temperature": 0.0}])  # type: ignore[list-item]
    assert_still_serves(llm)


def test_text_that_was_not_utf8_is_refused() -> None:
    llm = LLM(device="cpu")  # the embedded default model has a tokenizer
    not_utf8 = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")  # how argv carries Latin-1 bytes
    with pytest.raises(ValueError, match="is not valid UTF-8 text"):
        llm.generate([not_utf8], GREEDY)
    assert llm.generate(["café au lait"], GREEDY)[0].text is not None


@pytest.mark.parametrize(
    ("typo", "suggestion"),
    [("blok_size", "block_size"), ("max_num_seq", "max_num_seqs"), ("kv_cache_dtpe", "kv_cache_dtype")],
)
def test_override_typos_get_did_you_mean(v3_dir, typo: str, suggestion: str) -> None:  # type: ignore[no-untyped-def]
    expected = f"override '{typo}' matches no config field \\(did you mean '{suggestion}'"
    with pytest.raises(ConfigError, match=expected):
        LLM(v3_dir, **{typo: 1})
    with pytest.raises(ConfigError, match=f"unknown key engine.{typo} \\(did you mean '{suggestion}'"
                       if suggestion != "kv_cache_dtype" else "unknown key engine.kv_cache_dtpe"):
        LLM(v3_dir, **{f"engine.{typo}": 1})


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"config": 123}, "config must be a JackfieldConfig or a TOML path, got int"),
    ({"model": 1.5}, "model must be a model directory path, got float"),
])
def test_llm_arguments_of_the_wrong_type(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LLM(**kwargs)  # type: ignore[arg-type]

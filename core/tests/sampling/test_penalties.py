"""Presence, frequency and repetition penalties against a float64 element-by-element reference of
vLLM's (OpenAI's) definitions, and their place after logit bias and allowed tokens."""

from __future__ import annotations

import random

import pytest
import torch
from jackfield.contracts.sampler import SamplingMetadata, SamplingParams
from jackfield.sampling.processors import apply_processors, bias_and_mask_from_params, penalties_from_rows

VOCAB = 50


def reference(logit: float, token: int, prompt: list[int], output: list[int], p: SamplingParams) -> float:
    """One logit, in float64, straight from the definitions."""
    x = float(logit)
    if token in prompt or token in output:
        x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    count = output.count(token)
    return x - p.frequency_penalty * count - p.presence_penalty * (1.0 if count else 0.0)


def metadata(params: list[SamplingParams], prompts: list[list[int]],
             outputs: list[list[int]]) -> SamplingMetadata:
    rows = len(params)
    bias, mask = bias_and_mask_from_params(params, VOCAB, torch.device("cpu"))
    return SamplingMetadata(
        temperature=torch.ones(rows), top_k=torch.zeros(rows, dtype=torch.int64), top_p=torch.ones(rows),
        min_p=torch.zeros(rows), seeds=torch.zeros(rows, dtype=torch.int64),
        positions=torch.zeros(rows, dtype=torch.int64), logit_bias=bias, allowed_token_mask=mask,
        penalties=penalties_from_rows(params, prompts, outputs, VOCAB, torch.device("cpu")),
    )


def draw(rng: random.Random) -> tuple[list[SamplingParams], list[list[int]], list[list[int]]]:
    params = [SamplingParams(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
                             repetition_penalty=rng.uniform(0.2, 3.0)) for _ in range(5)]
    params.append(SamplingParams())  # a row without penalties in the same batch is left alone
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))] for _ in params]
    outputs = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 40))] for _ in params]
    return params, prompts, outputs


def test_penalties_match_the_float64_definitions(rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    params, prompts, outputs = draw(rng)
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(rng_seed)) * 4
    got = apply_processors(logits, metadata(params, prompts, outputs))
    want = torch.tensor([[reference(logits[r, t].item(), t, prompts[r], outputs[r], params[r])
                          for t in range(VOCAB)] for r in range(len(params))], dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)
    assert torch.equal(got[-1], logits[-1])
    assert not torch.equal(got[0], logits[0])  # the drawn penalties did change something


def test_penalties_apply_after_bias_and_allowed_tokens(rng_seed: int) -> None:
    """vLLM's order: bias first (a biased logit is what the repetition rule sees), -inf stays -inf."""
    rng = random.Random(rng_seed)
    token = rng.randrange(VOCAB)
    p = SamplingParams(repetition_penalty=2.0, logit_bias={token: 3.0},
                       allowed_token_ids=tuple(t for t in range(VOCAB) if t != (token + 1) % VOCAB))
    logits = torch.full((1, VOCAB), -1.0)
    got = apply_processors(logits, metadata([p], [[token, (token + 1) % VOCAB]], [[]]))
    assert got[0, token].item() == pytest.approx((-1.0 + 3.0) / 2.0)  # biased first, then divided
    assert got[0, (token + 1) % VOCAB].item() == float("-inf")


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -2.01),
                                         ("repetition_penalty", 0.0), ("n", 0), ("prompt_logprobs", -1)])
def test_out_of_range_values_are_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_seeded_samples_get_consecutive_seeds() -> None:
    children = SamplingParams(n=3, seed=41, temperature=0.5).per_sample()
    assert [c.seed for c in children] == [41, 42, 43] and {c.n for c in children} == {1}
    assert [c.seed for c in SamplingParams(n=2).per_sample()] == [None, None]

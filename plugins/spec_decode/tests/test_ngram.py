"""N-gram lookup against vLLM's published cases, and a brute-force reading of the rule."""

from __future__ import annotations

import random

import pytest
from jackfield.contracts.drafter import DrafterOptions
from jackfield_spec_decode.ngram import NgramDrafter, propose_ngram

# vLLM's cases: (tokens, prompt_lookup_min, prompt_lookup_max, k) -> proposal
VLLM_CASES = [
    ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 3, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2, [6, 2]),
    ([1, 2, 3, 4, 5], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 4, 4, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 3, 4, 2, [4, 1]),
    ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2, [1, 2]),
    ([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2, [1, 2]),
    ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2, [100, 1]),
]


@pytest.mark.parametrize(("tokens", "min_n", "max_n", "k", "want"), VLLM_CASES)
def test_vllm_cases(tokens: list[int], min_n: int, max_n: int, k: int, want: list[int]) -> None:
    assert propose_ngram(tokens, min_n, max_n, k) == want
    options = DrafterOptions(num_speculative_tokens=k, prompt_lookup_min=min_n, prompt_lookup_max=max_n)
    drafter = NgramDrafter(options)
    assert drafter.propose([tokens, [7]]).token_ids == [want, []]


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule as written: longest n first, earliest earlier occurrence, what followed it."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_random_sequences_match_the_rule_read_literally(rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    for _ in range(2000):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        min_n = rng.randrange(1, 5)
        max_n, k = rng.randrange(min_n, 7), rng.randrange(1, 6)
        want = brute_force(tokens, min_n, max_n, k)
        assert propose_ngram(tokens, min_n, max_n, k) == want, (tokens, min_n, max_n, k)


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min 3 must be >= 1 and <= prompt_lookup_max 2"):
        NgramDrafter(DrafterOptions(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2))
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        NgramDrafter(DrafterOptions(num_speculative_tokens=0))

"""`greedy_runs_agree`, the GPU engine tests' comparison of two greedy runs, on made-up outputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from jackfield.testing.checks import greedy_runs_agree

TOPS = [{1: -0.1, 2: -2.0, 3: -3.0, 4: -4.0, 5: -5.0}, {7: -0.5, 8: -0.52, 9: -3.0, 1: -4.0, 2: -5.0}]


def run(tokens: list[int], tops: list[dict[int, float]]) -> SimpleNamespace:
    return SimpleNamespace(token_ids=tokens, logprobs=tops)


def test_rounding_apart_agrees_and_counts_the_steps() -> None:
    nudged = [{t: v + 0.01 for t, v in top.items()} for top in TOPS]
    assert greedy_runs_agree([run([1, 7], TOPS)], [run([1, 7], nudged)]) == 2


def test_a_split_at_a_near_tie_stops_the_comparison() -> None:
    assert greedy_runs_agree([run([1, 7], TOPS)], [run([1, 8], TOPS)]) == 1


@pytest.mark.parametrize("case", ["logprob off", "split off a tie", "top tokens differ"])
def test_real_differences_fail(case: str) -> None:
    if case == "logprob off":
        got = run([1, 7], [TOPS[0], {**TOPS[1], 9: -2.9}])
    elif case == "split off a tie":
        got = run([2, 7], TOPS)
    else:
        got = run([1, 7], [TOPS[0], {7: -0.5, 8: -0.52, 20: -3.0, 21: -4.0, 22: -5.0}])
    with pytest.raises(AssertionError):
        greedy_runs_agree([run([1, 7], TOPS)], [got])

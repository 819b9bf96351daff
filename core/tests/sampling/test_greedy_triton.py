"""Greedy tokens from the two Triton kernels (sampling/greedy_triton.py) against PyTorch's path
(nan_to_num, then the first maximum of each row), with ties across and within chunks and rows
holding NaN, +-inf or no finite logit at all. On the CPU the kernels run in Triton's
interpreter. Inputs are fresh random draws (the seed is printed)."""

from __future__ import annotations

import math
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
                                reason="Triton needs CUDA or TRITON_INTERPRET=1")


def torch_greedy(logits: torch.Tensor) -> torch.Tensor:
    """The reference: the first maximum of the finite logits (torch.max returns the first), -1
    where none is finite."""
    best, tokens = torch.nan_to_num(logits, nan=-math.inf, posinf=-math.inf, neginf=-math.inf).max(dim=1)
    return torch.where(best == -math.inf, -1, tokens)


@pytest.mark.parametrize("vocab", [9000, 4096, 37])  # chunks: 3 (the last ragged), 1, part of 1
def test_greedy_tokens_are_the_first_finite_maximum(rng_seed: int, vocab: int) -> None:
    from jackfield.sampling import greedy_triton

    g = torch.Generator().manual_seed(rng_seed)
    rows = 9
    # few distinct values: ties within a chunk and across chunks are common
    logits = torch.randint(-40, 40, (rows, vocab + 5), generator=g).float() / 4
    logits = logits[:, :vocab]  # strided rows
    top = logits.max().item()
    cols = torch.randperm(vocab, generator=g)[:4].sort().values.tolist()
    logits[0, cols[2]] = logits[0, cols[1]] = top + 1  # a tie: the lower index wins
    logits[1, cols[0]] = math.nan  # never chosen, whatever its place
    logits[1, cols[3]] = math.inf  # never chosen: not finite
    logits[2, :] = -math.inf  # no finite logit
    logits[3, :] = math.nan
    logits[4, :] = logits[4, :].clamp(max=0)
    logits[4, cols[1]] = math.inf
    logits[5, :] = logits[5, 0]  # every logit tied: the first
    logits[6, cols[3]] = top + 2  # the maximum in a later chunk than other large values
    want = torch_greedy(logits)
    got = greedy_triton.greedy_tokens_triton(logits.to(DEVICE)).cpu()
    assert got.tolist() == want.tolist()
    assert got[0] == cols[1] and got[2] == got[3] == -1 and got[5] == 0 and got[6] == cols[3]
    assert got[1] not in (cols[0], cols[3]) and got[4] not in (cols[1], -1)

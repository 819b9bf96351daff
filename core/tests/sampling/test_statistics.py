"""The sampled frequencies follow softmax(logits / T): tail mass, chi-square, filters."""

from __future__ import annotations

import math

import pytest
import torch
from jackfield.sampling import sample


def draws(
    logits_row: torch.Tensor, n: int, temperature: float = 1.0, impl: str = "torch", **filters
) -> torch.Tensor:
    """n draws for one distribution: n rows of the same logits with distinct positions."""
    device = logits_row.device
    rows = 1024 if device.type == "cpu" else 4096
    out = []
    for start in range(0, n, rows):
        r = min(rows, n - start)
        f = {k: torch.full((r,), v, device=device) for k, v in filters.items()}
        out.append(
            sample(
                logits_row.expand(r, -1),
                torch.full((r,), temperature, device=device),
                torch.full((r,), 1234, dtype=torch.int64, device=device),
                torch.arange(start, start + r, device=device),
                impl=impl,
                **f,
            )
        )
    return torch.cat(out)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().double()
    expected = probs.double() * n
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    dof = probs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def tail_mass_z(tail: int, gap: float, n: int, device: str, impl: str) -> float:
    logits = torch.zeros(tail + 1, device=device)
    logits[tail // 2] = gap  # the head token sits mid-vocab
    logits[: tail // 2] = 0.0
    picked = draws(logits, n, impl=impl)
    p_tail = tail * math.exp(-gap) / (1 + tail * math.exp(-gap))
    hits = int((picked != tail // 2).sum())
    return (hits - n * p_tail) / math.sqrt(n * p_tail * (1 - p_tail))


def test_tail_mass_small() -> None:
    """CPU-sized: 500 tail tokens 9 nats below the head (tail mass ~6%), 6,000 draws."""
    assert abs(tail_mass_z(500, 9.0, 6000, "cpu", "torch")) < 5


@pytest.mark.gpu
def test_tail_mass_gap_18_over_100k_tokens() -> None:
    """One token 18 nats above 100k tail tokens (tail mass 1.5e-3), 262,144 draws: the tail wins
    only through noise values near u ~ 1e-7, which a coarse uniform would get wrong."""
    assert abs(tail_mass_z(100_000, 18.0, 262_144, "cuda", "triton")) < 5


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chi_square_over_the_full_vocabulary(temperature: float) -> None:
    g = torch.Generator().manual_seed(17)
    logits = torch.randn(32, generator=g) * 0.8
    n = 20000
    counts = torch.bincount(draws(logits, n, temperature), minlength=32)
    probs = torch.softmax(logits.double() / temperature, dim=0)
    assert chi_square_p_value(counts, probs) > 1e-6


def test_chi_square_after_top_k_top_p_min_p() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, generator=g)
    picked = draws(logits, 16000, top_k=40, top_p=0.8, min_p=0.05)
    # Independent float64 reference of the filters: top-k, top-p on the renormalized top-k, min-p.
    order = torch.argsort(logits.double(), descending=True)
    probs = torch.softmax(logits.double(), dim=0)
    keep = torch.zeros(64, dtype=torch.bool)
    keep[order[:40]] = True
    renorm = torch.where(keep, probs, 0.0) / probs[keep].sum()
    before = torch.cumsum(renorm[order], dim=0) - renorm[order]
    keep[order[before >= 0.8]] = False
    keep &= probs >= 0.05 * probs.max()
    target = torch.where(keep, probs, 0.0) / probs[keep].sum()
    counts = torch.bincount(picked, minlength=64)
    assert int(counts[~keep].sum()) == 0
    assert chi_square_p_value(counts[keep], target[keep]) > 1e-6


def test_neg_inf_tokens_are_never_sampled() -> None:
    logits = torch.randn(199, generator=torch.Generator().manual_seed(8))
    banned = torch.arange(0, 199, 2)
    logits[banned] = float("-inf")
    picked = draws(logits, 5000, temperature=3.0)
    assert not torch.isin(picked, banned).any()
    assert torch.unique(picked).numel() > 90  # still spread over the allowed half


@pytest.mark.parametrize("vocab", [1, 999, 1024, 4097])
def test_vocab_sizes(vocab: int) -> None:
    """The last token holds 30% of the mass (all of it at vocab 1), the rest is uniform."""
    head = 0.3 if vocab > 1 else 1.0
    logits = torch.zeros(vocab)
    if vocab > 1:
        logits[-1] = math.log(head / ((1 - head) / (vocab - 1)))
    n = 1000
    picked = draws(logits, n, temperature=1.0)
    assert int(picked.min()) >= 0 and int(picked.max()) < vocab
    hits = int((picked == vocab - 1).sum())
    if vocab == 1:
        assert hits == n
    else:
        assert abs(hits - n * head) < 5 * math.sqrt(n * head * (1 - head))

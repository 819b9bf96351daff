"""Draft verification against vLLM's greedy table and Leviathan et al.'s guarantee (the emitted
tokens are distributed as the target's), measured by chi-square over 100k seeded requests."""

from __future__ import annotations

import pytest
import torch
from jackfield.sampling.filters import filter_cutoffs
from jackfield.sampling.noise import DRAFT_POSITION_OFFSET, gumbel_noise
from jackfield.sampling.speculative import NO_TOKEN, rejection_verify, target_probabilities

# vLLM's greedy cases: drafts -> target argmax (one more than drafts: the last is the bonus) -> output
GREEDY_TABLE = [
    ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),
    ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5, -1, -1]]),
    ([[1, 2], [3]], [[1, 2, 5], [3, 4]], [[1, 2, 5], [3, 4, -1]]),
    ([[1]], [[1, 2]], [[1, 2]]),
    ([[]], [[5]], [[5]]),
    ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7, 6], [4, 8, 6, 9]], [[1, 2, 7, -1], [4, 8, -1, -1]]),
    ([[1]], [[2, 3]], [[2, -1]]),
    ([[1, 2], [3, 4]], [[1, 5, 6], [3, 4, 7]], [[1, 5, -1], [3, 4, 7]]),
]
VOCAB = 10


def pad(rows: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([row + [NO_TOKEN] * (width - len(row)) for row in rows], dtype=torch.int64).reshape(
        len(rows), width)


@pytest.mark.parametrize(("drafts", "targets", "want"), GREEDY_TABLE)
def test_greedy_table(drafts: list[list[int]], targets: list[list[int]], want: list[list[int]],
                      rng_seed: int) -> None:
    """Temperature 0: random logits whose argmax is the table's target token at each position."""
    g = torch.Generator().manual_seed(rng_seed)
    k = max(len(d) for d in drafts)
    logits = torch.randn(len(drafts), k, VOCAB, generator=g)
    for b, row in enumerate(targets):
        for j, token in enumerate(row[:-1]):
            logits[b, j, token] = logits[b, j].max() + 1.0
    greedy = torch.zeros(len(drafts) * k)
    probs = target_probabilities(logits.reshape(-1, VOCAB), greedy).reshape(logits.shape)
    bonus = torch.tensor([row[-1] for row in targets])
    seeds = torch.randint(0, 2**62, (len(drafts),), generator=g)
    out = rejection_verify(pad(drafts, k), probs, None, bonus, seeds, torch.randint(0, 1000, (len(drafts),)))
    assert out.tolist() == want


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of `counts` against `probs` (cells with expected counts >= 5 kept)."""
    expected = probs.double() * counts.sum()
    keep = expected >= 5
    stat = (((counts.double() - expected) ** 2) / expected)[keep].sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def gumbel_draw(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [N, V] by Gumbel-max over murmur3 noise at (seed, position)."""
    noise = gumbel_noise(seeds.unsqueeze(1), positions.unsqueeze(1), torch.arange(probs.shape[1]), fp64=True)
    return (probs.double().log() + noise).argmax(dim=1)


def emitted_distributions(k: int, num: int, g: torch.Generator, one_hot_drafts: bool,
                          draft_offset: int = DRAFT_POSITION_OFFSET,
                          ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(p [k+1, V], reached counts per position, emitted counts per position) of `num` requests
    drafting from fixed q_j (or as n-gram: a token from a fixed q_j that verification does not
    see) and verified against fixed p_j. Drafts come from the drafting stream (position + 2**30),
    as the engine draws them."""
    vocab = 6
    p = torch.distributions.Dirichlet(torch.ones(vocab)).sample((k + 1,))
    q = torch.distributions.Dirichlet(torch.ones(vocab)).sample((k,))
    seeds = torch.randint(0, 2**62, (num,), generator=g)
    positions = torch.randint(0, 2**20, (num,), generator=g)
    drafts = torch.stack([gumbel_draw(q[j].expand(num, vocab), seeds, positions + j + draft_offset)
                          for j in range(k)], 1)
    draft_probs = None if one_hot_drafts else q.expand(num, k, vocab)
    bonus = gumbel_draw(p[k].expand(num, vocab), seeds, positions + k)
    out = rejection_verify(drafts, p[:k].expand(num, k, vocab), draft_probs, bonus, seeds, positions)
    counts = [torch.bincount(out[:, j][out[:, j] >= 0], minlength=vocab) for j in range(k + 1)]
    return p, (out >= 0).sum(0), counts


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("one_hot_drafts", [False, True], ids=["draft_probs", "ngram"])
def test_emitted_tokens_are_distributed_as_the_target(k: int, one_hot_drafts: bool, rng_seed: int) -> None:
    g = torch.Generator().manual_seed(rng_seed)
    torch.manual_seed(rng_seed)  # the Dirichlet draws
    p, reached, counts = emitted_distributions(k, 100_000, g, one_hot_drafts)
    assert reached[0] == 100_000  # every request emits at least one token
    for j in range(k + 1):
        if reached[j] < 2000:  # too few requests got this far for the test to have power
            continue
        p_value = chi_square_p_value(counts[j], p[j])
        assert p_value > 1e-4, f"position {j}: chi-square p = {p_value:.2e}, counts {counts[j].tolist()}"


def test_top_k_rows_never_emit_an_excluded_token(rng_seed: int) -> None:
    """Uniform drafts over the whole vocabulary against top-2 targets: every emitted token is in
    its position's top 2, and recovered ids stay inside the vocabulary."""
    g = torch.Generator().manual_seed(rng_seed)
    num, k, vocab = 4000, 3, 50
    logits = torch.randn(num * k, vocab, generator=g) * 3
    temperature = torch.full((num * k,), 0.8)
    cutoff = filter_cutoffs(logits, temperature, torch.full((num * k,), 2), None, None)
    probs = target_probabilities(logits, temperature, cutoff).reshape(num, k, vocab)
    drafts = torch.randint(0, vocab, (num, k), generator=g)
    uniform = torch.full((num, k, vocab), 1.0 / vocab)
    bonus = torch.zeros(num, dtype=torch.int64)  # a token top-2 may exclude: never at a rejection
    out = rejection_verify(drafts, probs, uniform, bonus, torch.randint(0, 2**62, (num,), generator=g),
                           torch.zeros(num, dtype=torch.int64))
    top2 = logits.reshape(num, k, vocab).topk(2, dim=-1).indices
    for j in range(k):  # an accepted draft or a recovered token: both drawn where p > 0
        emitted = out[:, j]
        in_top2 = (top2[:, j] == emitted.unsqueeze(1)).any(dim=1)
        assert bool((in_top2 | (emitted < 0)).all()), f"position {j} emitted a token outside its top 2"
    assert bool((out < vocab).all()) and bool((out[:, 0] >= 0).all())
    assert bool((out[:, :k] != drafts).any())  # drafts outside the top 2 were really rejected


def test_a_request_gives_the_same_tokens_alone_and_in_any_batch(rng_seed: int) -> None:
    g = torch.Generator().manual_seed(rng_seed)
    num, k, vocab = 12, 4, 20
    probs = torch.distributions.Dirichlet(torch.ones(vocab)).sample((num, k))
    draft_probs = torch.distributions.Dirichlet(torch.ones(vocab)).sample((num, k))
    drafts = torch.randint(0, vocab, (num, k), generator=g)
    drafts[3, 2:] = NO_TOKEN  # ragged
    bonus = torch.randint(0, vocab, (num,), generator=g)
    seeds = torch.randint(0, 2**62, (num,), generator=g)
    positions = torch.randint(0, 2**20, (num,), generator=g)
    together = rejection_verify(drafts, probs, draft_probs, bonus, seeds, positions)
    for order in (torch.randperm(num, generator=g), torch.arange(num)):
        shuffled = rejection_verify(drafts[order], probs[order], draft_probs[order], bonus[order],
                                    seeds[order], positions[order])
        assert torch.equal(shuffled, together[order])
    for b in range(num):
        one = slice(b, b + 1)
        alone = rejection_verify(drafts[one], probs[one], draft_probs[one], bonus[one], seeds[one],
                                 positions[one])
        assert torch.equal(alone[0], together[b])
    other_seeds = rejection_verify(drafts, probs, draft_probs, bonus, seeds + 1, positions)
    assert not torch.equal(other_seeds, together)  # the seed matters


def test_bad_drafts_are_refused() -> None:
    probs = torch.full((1, 2, 5), 0.2)
    args = (None, torch.tensor([0]), torch.tensor([1]), torch.tensor([0]))
    with pytest.raises(ValueError, match="< vocab size 5"):
        rejection_verify(torch.tensor([[1, 5]]), probs, *args)
    with pytest.raises(ValueError, match="at the end only"):
        rejection_verify(torch.tensor([[NO_TOKEN, 1]]), probs, *args)
    with pytest.raises(ValueError, match="disagree"):
        rejection_verify(torch.tensor([[1, 2, 3]]), probs, *args)

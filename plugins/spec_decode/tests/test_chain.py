"""`draft_chain` (the loop MTP and EAGLE-3 share) against a plain per-request reference: each
request drafts up to its `max_drafts`, stops at its first draft with no finite logit, feeds each
draft back as the next row's token, and the chain reads the device once."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from jackfield.contracts.attention import StepContext
from jackfield.contracts.drafter import DraftContext, DraftRows
from jackfield_spec_decode.chain import draft_chain

VOCAB, HIDDEN = 11, 4


class FakeContext(DraftContext):
    """Greedy (or temperature-1) sampling of the logits; records the rows it was asked for."""

    def __init__(self, max_drafts: list[int], sampled: bool) -> None:
        self.max_drafts, self.sampled = max_drafts, sampled
        self.rows: list[tuple[list[int], int, list[int]]] = []

    def draft_rows(self, requests: Sequence[int], draft: int, input_ids: torch.Tensor,
                   hidden: torch.Tensor) -> DraftRows:
        self.rows.append((list(requests), draft, input_ids.clone()))
        return DraftRows(input_ids, torch.zeros_like(input_ids), hidden, StepContext([], ()))

    def block_attention(self, requests: Sequence[int],
                        sizes: Sequence[int]) -> tuple[StepContext, torch.Tensor]:
        raise AssertionError("a chain drafts no block")

    def sample(self, logits: torch.Tensor, requests: Sequence[int], draft: int,
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        best, tokens = torch.nan_to_num(logits, nan=-torch.inf, neginf=-torch.inf).max(dim=1)
        tokens = torch.where(best == -torch.inf, -1, tokens)
        return tokens, logits.softmax(-1) if self.sampled else None


@pytest.mark.parametrize("sampled", [False, True])
def test_the_chain_drafts_what_a_per_request_loop_drafts(sampled: bool, rng_seed: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    print(f"seed {rng_seed}")
    k, n = 4, 8
    g = torch.Generator().manual_seed(rng_seed)
    max_drafts = torch.randint(1, k + 1, (n,), generator=g).tolist()
    max_drafts[0] = k
    dead = {(1, 1), (2, 0), (0, 3)}  # (request, draft) rows with no finite logit
    embed = torch.randn(VOCAB, HIDDEN, generator=g)
    head = torch.randn(HIDDEN, VOCAB, generator=g)
    start = torch.cat((torch.arange(n)[:, None].float(), torch.randn(n, HIDDEN, generator=g)), 1)

    def forward(draft: int, rows: DraftRows) -> torch.Tensor:
        """Column 0 says which request a row is; the rest is a state moved by the fed token
        (F.embedding: an id < 0 raises)."""
        fed = torch.nn.functional.embedding(rows.input_ids, embed)
        return torch.cat((rows.hidden[:, :1], torch.tanh(rows.hidden[:, 1:] + 2 * fed)), 1)

    def logits(draft: int, hidden: torch.Tensor) -> torch.Tensor:
        out = hidden[:, 1:] @ head
        for i, r in enumerate(int(r) for r in hidden[:, 0]):  # no tolist(): the test counts those
            if (r, draft) in dead:
                out[i] = torch.nan if draft % 2 else -torch.inf
        return out

    def reference(r: int) -> tuple[list[int], list[torch.Tensor]]:
        """Request r alone: its drafts and the distributions they came from."""
        drafts, probs, hidden = [], [], start[r : r + 1]
        for draft in range(min(k, max_drafts[r])):
            if draft:
                rows = DraftRows(torch.tensor(drafts[-1:]), torch.zeros(1), hidden, StepContext([], ()))
                hidden = forward(draft, rows)
            row = logits(draft, hidden)[0]
            if not torch.isfinite(row).any():
                break
            drafts.append(int(row.argmax()))
            probs.append(row.softmax(-1))
        return drafts, probs

    context = FakeContext(max_drafts, sampled)
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real_tolist(t))
    proposal = draft_chain(context, k, start.clone(), logits, forward)
    monkeypatch.undo()
    assert len(reads) == 1  # the chain's one read-back
    want = [reference(r) for r in range(n)]
    assert proposal.token_ids == [drafts for drafts, _ in want]
    assert len({t for drafts, _ in want for t in drafts}) > 2  # drafts that tell requests apart
    assert [draft for _, draft, _ in context.rows] == list(range(1, max(max_drafts)))
    for requests, draft, fed in context.rows:  # a row for every request that may still draft
        assert requests == [r for r in range(n) if draft < max_drafts[r]]
        for r, token in zip(requests, fed.tolist(), strict=True):  # its previous draft if it has one
            drafts = want[r][0]
            assert token == drafts[draft - 1] if draft <= len(drafts) else token >= 0
    for r, probs in enumerate(proposal.probabilities):
        if sampled and want[r][0]:  # (a request with no draft has no probabilities)
            assert probs is not None
            torch.testing.assert_close(probs, torch.stack(want[r][1]))
        else:
            assert probs is None


def test_a_greedy_draft_row_without_a_finite_logit_draws_no_token() -> None:
    """The engine's `DraftContext.sample`: -1 for rows of -inf, NaN or +inf logits only (a
    default nan_to_num turned -inf into the lowest float, drawing token 0)."""
    from types import SimpleNamespace

    from jackfield.engine.drafting import RunnerDraftContext

    context = object.__new__(RunnerDraftContext)  # sample() reads only the drafting requests
    greedy = SimpleNamespace(params=SimpleNamespace(temperature=0.0))
    context.drafting = [(greedy, 5)] * 4
    inf, nan = torch.inf, torch.nan
    logits = torch.tensor([[-inf, -inf, -inf], [nan, nan, -inf], [inf, nan, -inf], [-inf, 3.0, 2.0]])
    tokens, probs = context.sample(logits, [0, 1, 2, 3], 0)
    assert tokens.tolist() == [-1, -1, -1, 1] and probs is None

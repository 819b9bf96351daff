"""The drafting loop model drafters share: draft 0 from the hidden states of the requests'
newest verified rows, then each further draft from one row per request that feeds the previous
draft's token and hidden state back through the drafter's layer, while requests may draft more."""

from __future__ import annotations

from collections.abc import Callable

import torch
from jackfield.contracts.drafter import DraftContext, DraftProposal, DraftRows


def draft_chain(context: DraftContext, num_speculative_tokens: int, hidden: torch.Tensor,
                logits: Callable[[int, torch.Tensor], torch.Tensor],
                forward: Callable[[int, DraftRows], torch.Tensor]) -> DraftProposal:
    """`hidden` [num_drafting, H] drafts token 0; `logits(draft, hidden)`: float32 [R, vocab];
    `forward(draft, rows)`: the hidden states [R, H] of the rows drafting token `draft` (>= 1),
    writing their KV."""
    requests = list(range(context.num_drafting))
    if not requests:
        return DraftProposal([], [])
    tokens, probs = context.sample(logits(0, hidden), requests, 0)
    drafts: list[list[int]] = [[] for _ in requests]
    chosen: list[list[torch.Tensor]] = [[] for _ in requests]
    for draft in range(num_speculative_tokens):
        if draft:
            hidden = forward(draft, context.draft_rows(requests, draft, tokens, hidden))
            tokens, probs = context.sample(logits(draft, hidden), requests, draft)
        keep = []
        for i, (r, token) in enumerate(zip(requests, tokens.tolist(), strict=True)):
            if token < 0:  # no finite logit: this request drafts no further
                continue
            drafts[r].append(token)
            if probs is not None:
                chosen[r].append(probs[i])
            if draft + 1 < context.max_drafts[r]:
                keep.append(i)
        if not keep:
            break
        if len(keep) < len(requests):
            index = torch.tensor(keep, device=hidden.device)
            requests, tokens, hidden = [requests[i] for i in keep], tokens[index], hidden[index]
    # A greedy request's rows may lack probabilities (a step of greedy rows only has none): it needs none.
    probabilities = [torch.stack(rows) if rows and len(rows) == len(d) else None
                     for rows, d in zip(chosen, drafts, strict=True)]
    return DraftProposal(drafts, probabilities)

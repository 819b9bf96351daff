"""The drafting loop model drafters share: draft 0 from the hidden states of the requests'
newest verified rows, then each further draft from one row per request that feeds the previous
draft's token and hidden state back through the drafter's layer, while requests may draft more.

The tokens stay on the device until the chain ends and come back in one read: the host queues
draft j + 1's kernels while the device still runs draft j's (a read per draft would wait for
each). A request whose draft j has no finite logit (token -1) drafts no further: its later rows
run on a stand-in token and are dropped at the read."""

from __future__ import annotations

from collections.abc import Callable

import torch
from jackfield.contracts.drafter import DraftContext, DraftProposal, DraftRows
from jackfield.ops.staging import async_tensor_h2d


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
    steps = [(requests, tokens, probs)]  # per draft: its requests, tokens [R] and probabilities
    for draft in range(1, num_speculative_tokens):
        keep = [i for i, r in enumerate(requests) if draft < context.max_drafts[r]]
        if not keep:
            break
        if len(keep) < len(requests):
            # pinned and asynchronous: a tensor made from a list on the device waits for the device
            index = async_tensor_h2d(keep, torch.int64, hidden.device, pin_memory=True)
            requests, tokens, hidden = [requests[i] for i in keep], tokens[index], hidden[index]
        rows = context.draft_rows(requests, draft, tokens.clamp(min=0), hidden)
        hidden = forward(draft, rows)
        tokens, probs = context.sample(logits(draft, hidden), requests, draft)
        steps.append((requests, tokens, probs))
    drawn = torch.cat([t for _, t, _ in steps]).tolist()  # the chain's one read-back
    num_drafting = context.num_drafting
    # Every request in every step, each with probabilities (the usual sampled chain): one stack
    # of the steps' probabilities, whose first rows of a request are its drafts' (a request stops
    # for good), rather than a stack per request.
    every_step = all(probs is not None and len(rows) == num_drafting for rows, _, probs in steps)
    drafts: list[list[int]] = [[] for _ in range(num_drafting)]
    chosen: list[list[torch.Tensor]] = [[] for _ in range(num_drafting)]
    stopped: set[int] = set()
    at = 0
    for step_requests, _, step_probs in steps:
        for i, r in enumerate(step_requests):
            token = drawn[at + i]
            if r in stopped or token < 0:  # no finite logit: this request drafts no further
                stopped.add(r)
                continue
            drafts[r].append(token)
            if step_probs is not None and not every_step:
                chosen[r].append(step_probs[i])
        at += len(step_requests)
    if every_step:
        stacked = torch.stack([probs for _, _, probs in steps], dim=1)  # type: ignore[misc]  # [R, steps, V]
        return DraftProposal(drafts, [stacked[r, : len(d)] if d else None for r, d in enumerate(drafts)])
    # A greedy request's rows may lack probabilities (a step of greedy rows only has none): it needs none.
    probabilities = [torch.stack(rows) if rows and len(rows) == len(d) else None
                     for rows, d in zip(chosen, drafts, strict=True)]
    return DraftProposal(drafts, probabilities)

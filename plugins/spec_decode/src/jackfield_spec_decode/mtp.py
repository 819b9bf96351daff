"""DeepSeek multi-token prediction (as vLLM's `mtp` method): the target checkpoint's MTP layers
draft, fed the target's own hidden states from the step that verified the previous drafts.

Each step (jackfield.contracts.drafter.DraftContext): every MTP layer runs over the step's
verified rows (row p: the token at p + 1 and the target's final hidden state at p), so each
layer's KV cache holds every verified position; layer 0's output at a request's newest row
drafts its first token. Draft j >= 1 comes from layer j mod n, one row per request continuing
from the previous draft's output (before the head's norm) with the token it drafted. Drafts are
sampled at the request's temperature from the drafting noise stream (argmax where greedy), and
their probabilities kept so the rejection rule's q is exact.

With n > 1 layers, layer i > 0 is fed the target's hidden states over the verified rows (the
DeepSeek-V3 report chains layer i from layer i - 1 at the same position, a chain drafting does not
follow); checkpoints published so far have n = 1.
"""

from __future__ import annotations

import torch
from jackfield.contracts.drafter import DraftContext, DraftProposal, ModelDrafter


class MTPDrafter(ModelDrafter):
    name = "mtp"

    def propose(self, context: DraftContext) -> DraftProposal:
        model, verified = context.model, context.verified
        num_layers = model.capabilities.num_mtp_layers
        for layer in range(num_layers - 1, -1, -1):  # layer 0 last: its output drafts
            out = model.mtp_forward(layer, verified.step, verified.input_ids, verified.positions,
                                    verified.hidden)
        requests = list(range(context.num_drafting))
        if not requests:
            return DraftProposal([], [])
        hidden = out[context.last_rows]
        tokens, probs = context.sample(model.mtp_logits(0, hidden), requests, 0)
        drafts: list[list[int]] = [[] for _ in requests]
        chosen: list[list[torch.Tensor]] = [[] for _ in requests]
        for draft in range(self.num_speculative_tokens):
            if draft:
                rows = context.draft_rows(requests, draft, tokens, hidden)
                layer = draft % num_layers
                hidden = model.mtp_forward(layer, rows.step, rows.input_ids, rows.positions, rows.hidden)
                tokens, probs = context.sample(model.mtp_logits(layer, hidden), requests, draft)
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

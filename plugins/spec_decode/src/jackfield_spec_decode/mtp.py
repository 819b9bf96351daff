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
from jackfield.contracts.drafter import DraftContext, DraftProposal, DraftRows, ModelDrafter

from jackfield_spec_decode.chain import draft_chain


class MTPDrafter(ModelDrafter):
    name = "mtp"

    def propose(self, context: DraftContext) -> DraftProposal:
        model, verified = context.model, context.verified
        num_layers = model.capabilities.num_mtp_layers
        for layer in range(num_layers - 1, -1, -1):  # layer 0 last: its output drafts
            out = model.mtp_forward(layer, verified.step, verified.input_ids, verified.positions,
                                    verified.hidden)

        def forward(draft: int, rows: DraftRows) -> torch.Tensor:
            layer = draft % num_layers
            return model.mtp_forward(layer, rows.step, rows.input_ids, rows.positions, rows.hidden)

        return draft_chain(context, self.num_speculative_tokens, out[context.last_rows],
                           lambda draft, hidden: model.mtp_logits(draft % num_layers, hidden), forward)

"""N-gram prompt lookup (as vLLM's `ngram` method): no model, no probabilities.

For n from prompt_lookup_max down to prompt_lookup_min, look for the request's last n tokens
earlier in the request; at the longest n that occurs, take its earliest occurrence and propose
the (up to k) tokens that followed it. No occurrence at any n: no draft.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jackfield.contracts.drafter import DrafterOptions, DraftProposal, TokenDrafter


def propose_ngram(token_ids: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The draft after `token_ids` (see the module docstring); [] when nothing matches."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting at 0 .. length - n - 1: every occurrence that ends before the suffix does.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramDrafter(TokenDrafter):
    name = "ngram"

    def __init__(self, options: DrafterOptions) -> None:
        super().__init__(options)
        if not 1 <= options.prompt_lookup_min <= options.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min {options.prompt_lookup_min} must be >= 1 and <= "
                             f"prompt_lookup_max {options.prompt_lookup_max}")

    @property
    def lookahead_tokens(self) -> int:
        """Lookup writes no KV of its own: only the verified drafts' slots, which the verify step
        reserves like any query row."""
        return 0

    def propose(self, token_ids: Sequence[Sequence[int]]) -> DraftProposal:
        o = self.options
        k = self.num_speculative_tokens
        return DraftProposal([propose_ngram(t, o.prompt_lookup_min, o.prompt_lookup_max, k)
                              for t in token_ids])

"""Draft vocabularies smaller than the target's (EAGLE-3, DFlash, DSpark heads).

A draft head may predict over a subset of the target's vocabulary: its checkpoint then stores
`d2t`, int64 offsets with draft id i standing for target id i + d2t[i] (EAGLE-3's published
layout). One helper turns that into the map the drafters scatter their logits through.
"""

from __future__ import annotations

import torch


def draft_to_target_ids(draft_vocab_size: int, target_vocab_size: int, d2t: torch.Tensor | None, *,
                        source: str) -> torch.Tensor | None:
    """int64 [draft_vocab_size]: the target id of each draft id (i + d2t[i]), or None when the
    draft vocabulary is the target model's own (no remap). `source` names where d2t was read
    (file and tensor) for the errors a bad one raises (ValueError)."""
    if draft_vocab_size < 1:
        raise ValueError(f"{source}: the draft vocabulary size must be >= 1, got {draft_vocab_size}")
    if draft_vocab_size == target_vocab_size:
        return None
    if draft_vocab_size > target_vocab_size:
        raise ValueError(f"{source}: the draft vocabulary ({draft_vocab_size}) is larger than the target "
                         f"model's ({target_vocab_size})")
    if d2t is None:
        raise ValueError(f"{source} is missing: a draft vocabulary of {draft_vocab_size} ids needs it to map "
                         f"them into the target model's {target_vocab_size}")
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool or tuple(d2t.shape) != (draft_vocab_size,):
        raise ValueError(f"{source}: expected integer offsets of shape [{draft_vocab_size}], got "
                         f"{d2t.dtype} {list(d2t.shape)}")
    ids = torch.arange(draft_vocab_size, dtype=torch.int64, device=d2t.device) + d2t.to(torch.int64)
    outside = ((ids < 0) | (ids >= target_vocab_size)).nonzero().flatten()
    if outside.numel():
        first = int(outside[0])
        raise ValueError(f"{source}: draft id {first} maps to {int(ids[first])}, outside the target "
                         f"model's vocabulary of {target_vocab_size} ({outside.numel()} ids do)")
    if torch.unique(ids).numel() != draft_vocab_size:
        raise ValueError(f"{source}: several draft ids map to one target id")
    return ids

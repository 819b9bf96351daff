"""Float64 references for the tests: dense softmax attention over keys gathered by position."""

from __future__ import annotations

import torch


def gather_keys(
    kv_cache: torch.Tensor, block_table: torch.Tensor, req: int, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    page = kv_cache.shape[1]
    blocks = block_table[req, positions // page].long()
    return kv_cache[blocks, positions % page].double() * scale


def attend_rows(
    q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sm_scale: float, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [H, D], keys [N, D], visible [N] bool -> out [H, rank], lse [H] (natural log; -inf if none)."""
    heads = q.shape[0]
    if not bool(visible.any()):
        return torch.zeros(heads, rank, dtype=torch.float64), torch.full(
            (heads,), float("-inf"), dtype=torch.float64
        )
    k = keys[visible]
    scores = (q.double() @ k.T) * sm_scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ k[:, :rank], lse


def decode_reference(
    query,
    kv_cache,
    block_table,
    seq_lens,
    query_start_loc,
    sm_scale,
    rank,
    causal=True,
    kv_scale=1.0,
    topk_indices=None,
):
    tokens, heads, _ = query.shape
    out = torch.zeros(tokens, heads, rank, dtype=torch.float64)
    lse = torch.zeros(tokens, heads, dtype=torch.float64)
    qsl = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_len = qsl[b + 1] - qsl[b]
        for i in range(q_len):
            t = qsl[b] + i
            if topk_indices is not None:
                positions = topk_indices[t].long()
                visible = (positions >= 0) & (positions < seq_len)
                positions = positions.clamp(min=0)
            else:
                positions = torch.arange(seq_len)
                limit = seq_len - q_len + i if causal else seq_len - 1
                visible = positions <= limit
            keys = gather_keys(kv_cache, block_table, b, positions, kv_scale)
            out[t], lse[t] = attend_rows(query[t], keys, visible, sm_scale, rank)
    return out, lse

"""Reference attention in plain PyTorch: the oracle every backend and kernel test is held to.

Computed in float32 for 16- and 32-bit inputs (torch_ref serves requests with it) and in float64
for a float64 query (what tests compare kernels with): `compute_dtype`.

Positions: a sequence of k_len keys and q_len queries; query row i sits at key position
k_len - q_len + i (the queries are the newest tokens). Causal: it sees keys at positions <= its own.
A sliding window of w tokens further limits it to positions > p - w (itself included).
"""

from __future__ import annotations

import torch


def compute_dtype(query: torch.Tensor) -> torch.dtype:
    """float32, or float64 for a float64 query."""
    return torch.promote_types(query.dtype, torch.float32)


def visibility_mask(
    q_len: int,
    k_len: int,
    *,
    causal: bool,
    sliding_window: int | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """[q_len, k_len] bool: which keys each query row sees (causal rows at negative positions,
    where q_len > k_len, see none)."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        visible &= k_pos <= q_pos
    if sliding_window is not None:
        if sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        visible &= k_pos > q_pos - sliding_window
    return visible


def topk_visibility(indices: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[tq, seq_len] bool: row i sees exactly the request-local positions indices[i] lists (-1: none)."""
    if bool((indices >= seq_len).any()) or bool((indices < -1).any()):
        raise ValueError(
            f"topk indices must be in [-1, seq_len={seq_len}), got {indices.min()}..{indices.max()}"
        )
    visible = torch.zeros(indices.shape[0], seq_len + 1, dtype=torch.bool, device=indices.device)
    visible.scatter_(1, torch.where(indices < 0, seq_len, indices).long(), True)  # -1: a dropped column
    return visible[:, :seq_len]


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    visible: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention of one sequence, in `compute_dtype(q)`.

    q [tq, H, D], k [tk, Hkv, D], v [tk, Hkv, Dv], visible [tq, tk] or [tq, H, tk] bool,
    sinks [H] logits added to the denominator only. H must be a multiple of Hkv (GQA: query head h
    reads kv head h // (H // Hkv)). Returns out [tq, H, Dv] and lse [tq, H] (the log of the
    denominator the output was normalized by). Rows that see no key: out 0, lse -inf.
    """
    tq, num_heads, _ = q.shape
    tk, num_kv_heads, _ = k.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} are not a multiple of kv heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    dtype = compute_dtype(q)
    # Query heads as [kv head, group] (head h = kv * group + g): no copy of K/V per query head.
    qg = q.to(dtype).unflatten(1, (num_kv_heads, group))
    scores = torch.einsum("qngd,knd->ngqk", qg, k.to(dtype)).flatten(0, 1) * scale  # [H, tq, tk]
    mask = visible[None] if visible.dim() == 2 else visible.permute(1, 0, 2)  # [1|H, tq, tk]
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, tq]; -inf where nothing is visible
    seen_any = torch.isfinite(lse)
    if sinks is not None:
        lse = torch.where(seen_any, torch.logaddexp(lse, sinks.to(dtype)[:, None]), lse)
    # exp(-inf - 0) = 0 keeps empty rows at exactly 0 instead of NaN.
    probs = torch.exp(scores - torch.where(seen_any, lse, 0.0)[..., None])
    out = torch.einsum("ngqk,knd->qngd", probs.unflatten(0, (num_kv_heads, group)), v.to(dtype)).flatten(1, 2)
    return out, lse.transpose(0, 1).contiguous()


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: list[int],
    cu_seqlens_k: list[int],
    scale: float,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of B packed sequences: sequence b owns q rows cu_q[b]:cu_q[b+1], k/v rows likewise.

    q [Tq, H, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv]. Returns out [Tq, H, Dv], lse [Tq, H] in `compute_dtype(q)`.
    """
    if len(cu_seqlens_q) != len(cu_seqlens_k):
        raise ValueError(f"cu_seqlens_q has {len(cu_seqlens_q)} entries, cu_seqlens_k {len(cu_seqlens_k)}")
    if cu_seqlens_q[-1] != q.shape[0] or cu_seqlens_k[-1] != k.shape[0] or k.shape[0] != v.shape[0]:
        raise ValueError(
            f"cu_seqlens end at ({cu_seqlens_q[-1]}, {cu_seqlens_k[-1]}) but q has {q.shape[0]} rows, "
            f"k {k.shape[0]}, v {v.shape[0]}"
        )
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2], dtype=compute_dtype(q))
    lse = q.new_empty(q.shape[0], q.shape[1], dtype=compute_dtype(q))
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1 = cu_seqlens_q[b], cu_seqlens_q[b + 1]
        k0, k1 = cu_seqlens_k[b], cu_seqlens_k[b + 1]
        visible = visibility_mask(
            q1 - q0, k1 - k0, causal=causal, sliding_window=sliding_window, device=q.device
        )
        out[q0:q1], lse[q0:q1] = dense_attention(q[q0:q1], k[k0:k1], v[k0:k1], scale, visible, sinks)
    return out, lse


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    topk_indices: torch.Tensor | None = None,
    kv_scale: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a batch of requests over paged caches, in `compute_dtype(query)`.

    Request b owns query rows query_start_loc[b]:query_start_loc[b+1] and seq_lens[b] keys; the key
    at position p lives in slot p % block_size of block block_table[b, p // block_size].
    query [T, H, Dk], key_cache [num_blocks, block_size, Hkv, Dk], value_cache [.., Hkv, Dv].
    MLA's latent cache [num_blocks, block_size, L + R] is both: key_cache = cache[:, :, None] and
    value_cache = cache[:, :, None, :L]. fp8 caches: keys are multiplied by kv_scale's first element,
    values by its last (one scale for both, or [key scale, value scale]).
    topk_indices [T, k] (request-local positions, -1 for none) replace causality and the window.
    Rows that see no key (a request without keys: a padded row) give out 0 and lse -inf.
    Returns out [T, H, Dv] and lse [T, H].
    """
    dtype = compute_dtype(query)
    tokens, num_heads, _ = query.shape
    block_size = key_cache.shape[1]
    out = query.new_zeros(tokens, num_heads, value_cache.shape[-1], dtype=dtype)
    lse = query.new_full((tokens, num_heads), float("-inf"), dtype=dtype)
    qsl = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = qsl[b], qsl[b + 1]
        if q0 == q1:
            continue
        pos = torch.arange(seq_len, device=key_cache.device)
        blocks, offsets = block_table[b, pos // block_size].long(), pos % block_size
        k, v = key_cache[blocks, offsets].to(dtype), value_cache[blocks, offsets].to(dtype)
        if kv_scale is not None:
            scales = torch.as_tensor(kv_scale, dtype=dtype, device=k.device).reshape(-1)
            k, v = k * scales[0], v * scales[-1]
        if topk_indices is None:
            visible = visibility_mask(
                q1 - q0, seq_len, causal=causal, sliding_window=sliding_window, device=query.device
            )
        else:
            visible = topk_visibility(topk_indices[q0:q1], seq_len)
        out[q0:q1], lse[q0:q1] = dense_attention(query[q0:q1], k, v, scale, visible, sinks)
    return out, lse

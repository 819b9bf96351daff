"""Reference attention in plain PyTorch, float32 accumulation: the oracle every backend is held to.

Positions: a sequence of k_len keys and q_len queries; query row i sits at key position
k_len - q_len + i (the queries are the newest tokens). Causal: it sees keys at positions <= its own.
A sliding window of w tokens further limits it to positions > p - w (itself included).
"""

from __future__ import annotations

import torch


def visibility_mask(
    q_len: int,
    k_len: int,
    *,
    causal: bool,
    sliding_window: int | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """[q_len, k_len] bool: which keys each query row sees."""
    if q_len > k_len and causal:
        raise ValueError(f"causal attention needs k_len >= q_len, got q_len={q_len}, k_len={k_len}")
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


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    visible: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention of one sequence, in float32.

    q [tq, H, D], k [tk, Hkv, D], v [tk, Hkv, Dv], visible [tq, tk] or [tq, H, tk] bool,
    sinks [H] logits added to the denominator only. H must be a multiple of Hkv (GQA: query head h
    reads kv head h // (H // Hkv)). Returns out [tq, H, Dv] float32 and lse [tq, H] float32 (the log
    of the denominator the output was normalized by). Rows that see no key: out 0, lse -inf.
    """
    tq, num_heads, _ = q.shape
    tk, num_kv_heads, _ = k.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} are not a multiple of kv heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    kf = k.float().repeat_interleave(group, dim=1)  # [tk, H, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    mask = visible[None] if visible.dim() == 2 else visible.permute(1, 0, 2)  # [1|H, tq, tk]
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, tq]; -inf where nothing is visible
    seen_any = torch.isfinite(lse)
    if sinks is not None:
        lse = torch.where(seen_any, torch.logaddexp(lse, sinks.float()[:, None]), lse)
    # exp(-inf - 0) = 0 keeps empty rows at exactly 0 instead of NaN.
    probs = torch.exp(scores - torch.where(seen_any, lse, 0.0)[..., None])
    out = torch.einsum("hqk,khd->qhd", probs, vf)
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

    q [Tq, H, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv]. Returns out [Tq, H, Dv] float32, lse [Tq, H] float32.
    """
    if len(cu_seqlens_q) != len(cu_seqlens_k):
        raise ValueError(f"cu_seqlens_q has {len(cu_seqlens_q)} entries, cu_seqlens_k {len(cu_seqlens_k)}")
    if cu_seqlens_q[-1] != q.shape[0] or cu_seqlens_k[-1] != k.shape[0] or k.shape[0] != v.shape[0]:
        raise ValueError(
            f"cu_seqlens end at ({cu_seqlens_q[-1]}, {cu_seqlens_k[-1]}) but q has {q.shape[0]} rows, "
            f"k {k.shape[0]}, v {v.shape[0]}"
        )
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float32)
    lse = q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1 = cu_seqlens_q[b], cu_seqlens_q[b + 1]
        k0, k1 = cu_seqlens_k[b], cu_seqlens_k[b + 1]
        visible = visibility_mask(
            q1 - q0, k1 - k0, causal=causal, sliding_window=sliding_window, device=q.device
        )
        out[q0:q1], lse[q0:q1] = dense_attention(q[q0:q1], k[k0:k1], v[k0:k1], scale, visible, sinks)
    return out, lse

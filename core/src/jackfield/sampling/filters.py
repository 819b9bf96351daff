"""Top-k / top-p / min-p as one per-row cutoff on the float32 logits: keep a token iff logit >= cutoff.

A single cutoff is what both samplers (PyTorch and Triton) read, so they mask the same tokens.
The cutoff is always <= the row's largest finite logit, so masking never removes the argmax; ties
at the cutoff are all kept. Order (as in vLLM): top-k, then top-p on the renormalized top-k
distribution, then min-p (relative to the most likely token, so it ignores renormalization).
Non-finite logits (NaN, +-inf) are never sampled and take no part in the filters.
Top-p's boundary comes from a library softmax and cumsum: the same on one device for both
samplers, but a CPU and a GPU may round a token sitting exactly at the boundary differently.
"""

from __future__ import annotations

import torch

from jackfield.sampling.noise import log_f32


def finite_or_neg_inf(logits: torch.Tensor) -> torch.Tensor:
    """float32 logits with NaN and +-inf replaced by -inf (the tokens that are never sampled)."""
    x = logits.to(torch.float32)
    return torch.where(torch.isfinite(x), x, float("-inf"))


def filter_cutoffs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor | None:
    """float32 [R] cutoffs (-inf where a row keeps everything), or None when no row filters.

    top_k int64 (<= 0 or >= vocab: off), top_p float32 (1: off), min_p float32 (0: off).
    Greedy rows (temperature 0) are never filtered: their argmax survives any filter.
    """
    if top_k is None and top_p is None and min_p is None:
        return None  # plain temperature sampling: no device sync, no sort
    num_rows, vocab = logits.shape
    sampled = temperature > 0
    k = top_k if top_k is not None else torch.zeros(num_rows, dtype=torch.int64, device=logits.device)
    k = torch.where((k > 0) & (k < vocab) & sampled, k, 0)
    p = top_p if top_p is not None else torch.ones(num_rows, dtype=torch.float32, device=logits.device)
    p = torch.where(sampled, p.to(torch.float32), 1.0)
    mp = min_p if min_p is not None else torch.zeros(num_rows, dtype=torch.float32, device=logits.device)
    mp = torch.where(sampled, mp.to(torch.float32), 0.0)
    uses_k, uses_p, uses_min_p = bool((k > 0).any()), bool((p < 1).any()), bool((mp > 0).any())
    if not (uses_k or uses_p or uses_min_p):
        return None

    x = finite_or_neg_inf(logits)
    cutoff = torch.full((num_rows,), float("-inf"), dtype=torch.float32, device=logits.device)
    safe_t = torch.where(sampled, temperature.to(torch.float32), 1.0)
    if uses_min_p:
        # p_i >= min_p * p_max  <=>  x_i >= x_max + T * log(min_p)
        row_max = x.max(dim=1).values
        log_mp = log_f32(torch.where(mp > 0, mp, 1.0).clamp(min=2.0**-126))  # same bits on any device
        cutoff = torch.where(mp > 0, row_max + safe_t * log_mp, cutoff)
    if not (uses_k or uses_p):
        return cutoff

    # Only top-p rows without a top-k need the whole sorted row; otherwise the top max(k) suffice.
    needs_full_sort = bool((p < 1).logical_and(k == 0).any())
    width = vocab if needs_full_sort else int(k.max())
    values = torch.topk(x, width, dim=1, sorted=True).values  # descending
    k_eff = torch.where(k > 0, k, width)
    kth_value = values.gather(1, (k_eff - 1).unsqueeze(1)).squeeze(1)
    cutoff = torch.where(k > 0, torch.maximum(cutoff, kth_value), cutoff)
    if uses_p:
        candidate = values >= kth_value.unsqueeze(1)
        scaled = torch.where(candidate, values / safe_t.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scaled, dim=1).nan_to_num(0.0)  # an all -inf row has no mass
        mass_before = torch.cumsum(probs, dim=1) - probs
        keep = candidate & (mass_before < p.unsqueeze(1))
        keep[:, 0] = True
        last_kept = keep.sum(dim=1) - 1  # keep is a prefix of the descending values
        p_value = values.gather(1, last_kept.unsqueeze(1)).squeeze(1)
        cutoff = torch.where(p < 1, torch.maximum(cutoff, p_value), cutoff)
    return cutoff

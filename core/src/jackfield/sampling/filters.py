"""Top-k / top-p / min-p as one per-row cutoff on the float32 logits: keep a token iff logit >= cutoff.

A single cutoff is what both samplers (PyTorch and Triton) read, so they mask the same tokens.
The cutoff is always <= the row's largest finite logit, so masking never removes the argmax; ties
at the cutoff are all kept. Order (as in vLLM): top-k, then top-p on the renormalized top-k
distribution, then min-p (relative to the most likely token, so it ignores renormalization).
Non-finite logits (NaN, +-inf) are never sampled and take no part in the filters.

Top-p is defined so that every device computes the same boundary bit for bit (the Triton filter
kernel, filters_triton.py, mirrors it): over the first k values of the descending row (all of them
without top-k), the weight of value v is the integer trunc(exp32(v/T - v0/T) * 2^32) with v0 the
row's largest value and exp32 built from IEEE float32 +, -, * (`exp_f32`); prefix sums are int64
(exact, so their order does not matter), and position i is kept iff float64(sum of weights
before i) < float64(top_p) * float64(sum of all k weights); position 0 is always kept. The
cutoff is the value at the last kept position.
"""

from __future__ import annotations

import torch

from jackfield.sampling.noise import F32_LN2_HI, F32_LN2_LO, log_f32

F32_INV_LN2 = 1.44269502162933349609375  # float32(1 / ln 2)
# 1 / k! for k = 6 .. 0 as float32: the Horner form of exp(r) on |r| <= ln(2) / 2.
F32_INV_FACTORIALS = (
    0.001388888922519981861114501953125,
    0.008333333767950534820556640625,
    0.0416666679084300994873046875,
    0.16666667163372039794921875,
    0.5,
    1.0,
    1.0,
)
TOP_P_MIN_EXPONENT = -32.0  # exp(-32) * 2^32 < 1: weights below this are 0 anyway
TOP_P_WEIGHT_SCALE = 2.0**32


def finite_or_neg_inf(logits: torch.Tensor) -> torch.Tensor:
    """float32 logits with NaN and +-inf replaced by -inf (the tokens that are never sampled)."""
    x = logits.to(torch.float32)
    return torch.where(torch.isfinite(x), x, float("-inf"))


def exp_f32(d: torch.Tensor) -> torch.Tensor:
    """exp(d) for float32 d in [-32, 0] from IEEE +, -, * alone (a few ulps; same bits anywhere).

    d = n ln 2 + r with n = floor(d / ln 2 + 1/2), r in [-ln 2 / 2, ln 2 / 2]; exp(r) by a
    degree-6 Taylor polynomial; 2^n from its float32 bits.
    """
    n = torch.floor(d * F32_INV_LN2 + 0.5)
    r = (d - n * F32_LN2_HI) - n * F32_LN2_LO  # n * LN2_HI is exact for |n| < 2^8
    poly = torch.full_like(r, F32_INV_FACTORIALS[0])
    for c in F32_INV_FACTORIALS[1:]:
        poly = c + r * poly
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return poly * scale


def top_p_weights(values: torch.Tensor, row_max: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """int64 trunc(exp_f32(v/T - v0/T) * 2^32) for finite v, 0 for -inf (see the module docstring)."""
    d = values / temperature.unsqueeze(1) - (row_max / temperature).unsqueeze(1)
    e = exp_f32(torch.clamp(d, min=TOP_P_MIN_EXPONENT))
    w = (e * TOP_P_WEIGHT_SCALE).to(torch.int64)
    return torch.where(values > float("-inf"), w, 0)


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
    One device sync (which filters are on, how wide a top-k) when any filter tensor is given.
    """
    if top_k is None and top_p is None and min_p is None:
        return None  # plain temperature sampling: no device sync, no sort
    num_rows, vocab = logits.shape
    device = logits.device
    sampled = temperature > 0
    k = (
        top_k.to(torch.int64)
        if top_k is not None
        else torch.zeros(num_rows, dtype=torch.int64, device=device)
    )
    k = torch.where((k > 0) & (k < vocab) & sampled, k, 0)
    p = top_p if top_p is not None else torch.ones(num_rows, dtype=torch.float32, device=device)
    p = torch.where(sampled, p.to(torch.float32), 1.0)
    mp = min_p if min_p is not None else torch.zeros(num_rows, dtype=torch.float32, device=device)
    mp = torch.where(sampled, mp.to(torch.float32), 0.0)
    uses_p_rows = p < 1
    flags = torch.stack(
        [
            (k > 0).any(),
            uses_p_rows.any(),
            (mp > 0).any(),
            (uses_p_rows & (k == 0)).any(),  # top-p without top-k: the whole row is sorted
            k.max() if num_rows else torch.zeros((), dtype=torch.int64, device=device),
        ]
    ).tolist()
    uses_k, uses_p, uses_min_p, needs_full_sort, k_max = (int(f) for f in flags)
    if not (uses_k or uses_p or uses_min_p):
        return None

    x = finite_or_neg_inf(logits)
    cutoff = torch.full((num_rows,), float("-inf"), dtype=torch.float32, device=device)
    safe_t = torch.where(sampled, temperature.to(torch.float32), 1.0)
    if uses_min_p:
        # p_i >= min_p * p_max  <=>  x_i >= x_max + T * log(min_p)
        row_max = x.max(dim=1).values
        log_mp = log_f32(torch.where(mp > 0, mp, 1.0).clamp(min=2.0**-126))  # same bits on any device
        cutoff = torch.where(mp > 0, row_max + safe_t * log_mp, cutoff)
    if not (uses_k or uses_p):
        return cutoff

    width = vocab if needs_full_sort else k_max
    values = torch.topk(x, width, dim=1, sorted=True).values  # descending
    k_eff = torch.where(k > 0, k, width)
    kth_value = values.gather(1, (k_eff - 1).unsqueeze(1)).squeeze(1)
    cutoff = torch.where(k > 0, torch.maximum(cutoff, kth_value), cutoff)
    if uses_p:
        in_top = torch.arange(width, device=device).unsqueeze(0) < k_eff.unsqueeze(1)
        weights = torch.where(in_top, top_p_weights(values, values[:, 0], safe_t), 0)
        before = torch.cumsum(weights, dim=1) - weights
        bound = p.to(torch.float64) * weights.sum(dim=1).to(torch.float64)
        keep = in_top & (before.to(torch.float64) < bound.unsqueeze(1))
        keep[:, 0] = True
        last_kept = keep.sum(dim=1) - 1  # keep is a prefix of the descending values
        p_value = values.gather(1, last_kept.unsqueeze(1)).squeeze(1)
        cutoff = torch.where(p < 1, torch.maximum(cutoff, p_value), cutoff)
    return cutoff

"""Top-k / top-p / min-p in Triton without sorting the row, and sampling of the top-k rows.

For a row with top_k = k in [1, KMAX] (and any top_p / min_p), the k-th largest logit is found
from a lower bound and a short candidate list:
1. `_group_max` (program per (row, 4096 tokens)): the maximum finite logit of each group of GS
   consecutive tokens (GS chosen so that a row has at most 4096 groups).
2. `_filter_and_sample` (program per row): tau = the k-th largest group maximum. k groups hold a
   logit >= tau, so the row's k-th largest logit is >= tau: every token that top-k can keep lies
   in a group whose maximum is >= tau (typically k groups) and is itself >= tau (typically k + a
   few tokens). Those candidates are gathered (at most CAP), sorted, and the cutoff is computed
   exactly as filters.py does it (k-th value, the integer top-p weights, min-p from the row
   maximum). The kept tokens are all candidates, so the exact Gumbel-max over the candidates is
   the row's sample: the same (token, score) as gumbel_torch.py over the whole row.
Other rows get a status: 1 = sample the whole row with this cutoff (greedy rows, min-p only, no
filter), 2 = the cutoff needs filters.py (top-p without top-k, top_k > KMAX, more than CAP
candidates, e.g. many tied logits). `flags` collects the statuses as bits, read with one sync.
Compiled with enable_fp_fusion=False: every float operation mirrors filters.py / noise.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jackfield.ops.launch import DirectLauncher
from jackfield.sampling import filters, noise
from jackfield.sampling.gumbel_triton import _NO_INDEX, _gumbel_f32, _log_f32, _row_hash, load_temperature

KMAX = 256  # largest top_k handled here
CAP = 512  # candidates per row (>= KMAX; typically k + a few)
MAX_GROUPS = 4096
GROUP_TILE = 4096  # tokens per _group_max program
CANDIDATE_TILE = 2048  # tokens gathered per step in _filter_and_sample

DONE, NEEDS_SAMPLING, NEEDS_TORCH_CUTOFF = 0, 1, 2
_DONE, _NEEDS_SAMPLING, _NEEDS_TORCH_CUTOFF = (
    tl.constexpr(s) for s in (DONE, NEEDS_SAMPLING, NEEDS_TORCH_CUTOFF)
)

_INV_LN2 = tl.constexpr(filters.F32_INV_LN2)
_LN2_HI = tl.constexpr(noise.F32_LN2_HI)
_LN2_LO = tl.constexpr(noise.F32_LN2_LO)
_F6, _F5, _F4, _F3, _F2, _F1, _F0 = (tl.constexpr(c) for c in filters.F32_INV_FACTORIALS)
_MIN_EXPONENT = tl.constexpr(filters.TOP_P_MIN_EXPONENT)
_WEIGHT_SCALE = tl.constexpr(filters.TOP_P_WEIGHT_SCALE)
_INT32_MIN = tl.constexpr(-(2**31))


@triton.jit
def _group_max(
    logits_ptr, row_stride, group_max_ptr, flags_ptr, vocab, num_groups, GS: tl.constexpr,
    GROUPS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    if (row == 0) & (tl.program_id(1) == 0):
        tl.store(flags_ptr, 0)  # _filter_and_sample (the next launch) ORs the statuses into it
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    index = group[:, None] * GS + tl.arange(0, GS)[None, :]
    x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + index, mask=index < vocab, other=float("-inf"))
    x = x.to(tl.float32)
    x = tl.where(tl.abs(x) < float("inf"), x, float("-inf"))  # NaN and +inf are never sampled
    tl.store(group_max_ptr + row * num_groups + group, tl.max(x, axis=1), mask=group < num_groups)


@triton.jit
def _kth_largest(values, k):
    """The k-th largest of float32 `values` (no NaN), by bisection on order-preserving int keys;
    -inf when there are fewer than k values."""
    bits = values.to(tl.int32, bitcast=True)
    keys = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
    lo = tl.full((), _INT32_MIN, tl.int64)  # invariant: count(keys >= hi + 1) < k
    hi = tl.full((), 2**31 - 1, tl.int64)
    for _ in range(32):
        mid = (lo + hi + 1) >> 1
        enough = tl.sum((keys >= mid).to(tl.int32), axis=0) >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    key = lo.to(tl.int32)
    value = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    return tl.where(lo == _INT32_MIN, float("-inf"), value)


@triton.jit
def _top_p_weight(v, v0, temperature):
    """filters.top_p_weights for one row: int64 trunc(exp_f32(v/T - v0/T) * 2^32), 0 for -inf."""
    v0 = tl.where(v0 > float("-inf"), v0, 0.0)  # -inf entries get weight 0: keep them NaN-free
    v = tl.where(v > float("-inf"), v, v0)
    d = tl.math.div_rn(v, temperature) - tl.math.div_rn(v0, temperature)
    d = tl.maximum(d, _MIN_EXPONENT)
    n = tl.floor(d * _INV_LN2 + 0.5)
    r = (d - n * _LN2_HI) - n * _LN2_LO
    poly = _F5 + r * _F6
    poly = _F4 + r * poly
    poly = _F3 + r * poly
    poly = _F2 + r * poly
    poly = _F1 + r * poly
    poly = _F0 + r * poly
    scale = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return ((poly * scale) * _WEIGHT_SCALE).to(tl.int64)


@triton.jit
def _filter_and_sample(
    logits_ptr, row_stride, temperature_ptr, seed_ptr, pos_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    group_max_ptr, group_list_ptr, cand_value_ptr, cand_index_ptr,
    token_ptr, score_ptr, cutoff_ptr, status_ptr, flags_ptr, vocab, num_groups,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_MIN_P: tl.constexpr, GS: tl.constexpr,
    GROUPS_POW2: tl.constexpr, TILE_GROUPS: tl.constexpr, KMAX: tl.constexpr, CAP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    temperature = load_temperature(temperature_ptr, row)  # sanitized as it loads, as are p, min_p
    sampled = temperature > 0.0
    k = tl.full((), 0, tl.int64)
    if HAS_K:
        k = tl.load(top_k_ptr + row).to(tl.int64)
    k = tl.where(sampled & (k > 0) & (k < vocab), k, 0)
    p = tl.full((), 1.0, tl.float32)
    if HAS_P:
        p = tl.load(top_p_ptr + row)
        p = tl.where(sampled & (p == p), p, 1.0)  # NaN: off
    groups = tl.arange(0, GROUPS_POW2)
    in_row = groups < num_groups
    group_max = tl.load(group_max_ptr + row * num_groups + groups, mask=in_row, other=float("-inf"))
    cutoff = tl.full((), float("-inf"), tl.float32)
    if HAS_MIN_P:  # p_i >= min_p * p_max  <=>  x_i >= x_max + T * log(min_p), as in filters.py
        min_p = tl.load(min_p_ptr + row)
        min_p = tl.where(sampled & (min_p == min_p), tl.minimum(tl.maximum(min_p, 0.0), 1.0), 0.0)
        log_mp = _log_f32(tl.maximum(tl.where(min_p > 0.0, min_p, 1.0), 1.1754943508222875e-38))
        cutoff = tl.where(min_p > 0.0, tl.max(group_max, axis=0) + temperature * log_mp, cutoff)

    status = tl.full((), _NEEDS_SAMPLING, tl.int32)
    if (k > 0) & (k <= KMAX):
        # Groups that can hold a top-k logit, listed in scratch memory.
        tau = _kth_largest(group_max, k)
        candidate_group = in_row & (group_max >= tau) & (group_max > float("-inf"))
        slot = tl.cumsum(candidate_group.to(tl.int32), axis=0) - 1
        tl.store(group_list_ptr + row * GROUPS_POW2 + slot, groups, mask=candidate_group)
        num_candidate_groups = tl.sum(candidate_group.to(tl.int32), axis=0)
        tl.debug_barrier()
        # Their logits >= tau, gathered in index order into at most CAP slots.
        row_logits = logits_ptr + row.to(tl.int64) * row_stride
        tile = tl.arange(0, TILE_GROUPS)
        count = tl.full((), 0, tl.int32)
        for first in range(0, num_candidate_groups, TILE_GROUPS):
            listed = first + tile < num_candidate_groups
            group = tl.load(group_list_ptr + row * GROUPS_POW2 + first + tile, mask=listed, other=0)
            index = group[:, None] * GS + tl.arange(0, GS)[None, :]
            valid = listed[:, None] & (index < vocab)
            x = tl.load(row_logits + index, mask=valid, other=float("-inf")).to(tl.float32)
            take = tl.reshape(valid & (x >= tau) & (tl.abs(x) < float("inf")), (TILE_GROUPS * GS,))
            place = count + tl.cumsum(take.to(tl.int32), axis=0) - 1
            fits = take & (place < CAP)
            tl.store(cand_value_ptr + row * CAP + place, tl.reshape(x, (TILE_GROUPS * GS,)), mask=fits)
            tl.store(cand_index_ptr + row * CAP + place, tl.reshape(index, (TILE_GROUPS * GS,)), mask=fits)
            count += tl.sum(take.to(tl.int32), axis=0)
        tl.debug_barrier()
        if count <= CAP:
            status = tl.full((), _DONE, tl.int32)
            c = tl.arange(0, CAP)
            gathered = c < count
            value = tl.load(cand_value_ptr + row * CAP + c, mask=gathered, other=float("-inf"))
            index = tl.load(cand_index_ptr + row * CAP + c, mask=gathered, other=0)
            # The first k of `desc` are the first k of the sorted row (-inf past the finite ones).
            desc = tl.sort(value, descending=True)
            kth_value = tl.max(tl.where(c == k - 1, desc, float("-inf")), axis=0)
            cutoff = tl.maximum(cutoff, kth_value)
            if p < 1.0:
                weight = _top_p_weight(desc, tl.max(desc, axis=0), temperature)
                weight = tl.where((c < k) & (desc > float("-inf")), weight, 0)
                before = tl.cumsum(weight, axis=0) - weight
                bound = p.to(tl.float64) * tl.sum(weight, axis=0).to(tl.float64)
                keep = ((c < k) & (before.to(tl.float64) < bound)) | (c == 0)
                last_kept = tl.sum(keep.to(tl.int32), axis=0) - 1
                cutoff = tl.maximum(cutoff, tl.max(tl.where(c == last_kept, desc, float("-inf")), axis=0))
            # Every kept token is a candidate: the exact Gumbel-max over them is the row's sample.
            row_hash = _row_hash(seed_ptr, pos_ptr, row)
            score = tl.math.div_rn(value, temperature) + _gumbel_f32(row_hash, index.to(tl.uint32))
            score = tl.where(gathered & (value >= cutoff), score, float("-inf"))
            top = tl.max(score, axis=0)
            token = tl.min(tl.where(score == top, index, _NO_INDEX), axis=0)
            tl.store(token_ptr + row, tl.where(token == _NO_INDEX, 0, token).to(tl.int64))
            tl.store(score_ptr + row, top)
        else:
            status = tl.full((), _NEEDS_TORCH_CUTOFF, tl.int32)
    elif (k > 0) | (p < 1.0):
        status = tl.full((), _NEEDS_TORCH_CUTOFF, tl.int32)  # top_k > KMAX, or top-p over the whole row
    tl.store(cutoff_ptr + row, cutoff)
    tl.store(status_ptr + row, status)
    tl.atomic_or(flags_ptr, tl.full((), 1, tl.int32) << status)


launch_group_max = DirectLauncher(_group_max)
launch_filter_and_sample = DirectLauncher(_filter_and_sample)


def group_size(vocab: int) -> int:
    """Tokens per group: a power of two giving at most MAX_GROUPS groups."""
    return triton.next_power_of_2(triton.cdiv(vocab, MAX_GROUPS))


def _row_outputs(num_rows: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """token (int64), score, cutoff (float32) and status (int32), one per row."""
    return (
        torch.empty(num_rows, dtype=torch.int64, device=device),
        torch.empty(num_rows, dtype=torch.float32, device=device),
        torch.empty(num_rows, dtype=torch.float32, device=device),
        torch.empty(num_rows, dtype=torch.int32, device=device),
    )


def filter_and_sample_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, score, cutoff, status, flags): token/score are final where status == DONE; cutoff is
    the filters.py cutoff where status == NEEDS_SAMPLING; flags (int32 [1]) has bit 1 << s set for
    every status s present. logits [R, V] with unit stride along the vocab."""
    num_rows, vocab = logits.shape
    device = logits.device
    gs = group_size(vocab)
    num_groups = triton.cdiv(vocab, gs)
    groups_pow2 = triton.next_power_of_2(num_groups)
    flags = torch.empty(1, dtype=torch.int32, device=device)
    if num_rows == 0:
        return *_row_outputs(0, device), flags.zero_()
    group_max = torch.empty((num_rows, num_groups), dtype=torch.float32, device=device)
    groups_per_program = max(1, GROUP_TILE // gs)
    launch_group_max(
        (num_rows, triton.cdiv(num_groups, groups_per_program)),
        logits, logits.stride(0), group_max, flags, vocab, num_groups, GS=gs, GROUPS=groups_per_program,
        num_warps=4,
    )  # fmt: skip
    # Allocated while the GPU runs the first kernel (host time before it would delay the GPU).
    token, score, cutoff, status = _row_outputs(num_rows, device)
    group_list = torch.empty((num_rows, groups_pow2), dtype=torch.int32, device=device)
    cand_value = torch.empty((num_rows, CAP), dtype=torch.float32, device=device)
    cand_index = torch.empty((num_rows, CAP), dtype=torch.int32, device=device)
    launch_filter_and_sample(
        (num_rows,),
        logits, logits.stride(0), temperature, seeds, positions,
        top_k if top_k is not None else temperature, top_p if top_p is not None else temperature,
        min_p if min_p is not None else temperature,
        group_max, group_list, cand_value, cand_index, token, score, cutoff, status, flags, vocab, num_groups,
        HAS_K=top_k is not None, HAS_P=top_p is not None, HAS_MIN_P=min_p is not None, GS=gs,
        GROUPS_POW2=groups_pow2, TILE_GROUPS=max(1, CANDIDATE_TILE // gs), KMAX=KMAX, CAP=CAP,
        num_warps=8, enable_fp_fusion=False,
    )  # fmt: skip
    return token, score, cutoff, status, flags

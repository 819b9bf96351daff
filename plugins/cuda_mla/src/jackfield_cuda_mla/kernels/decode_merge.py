"""Stage 2 of split-KV MLA decode: merge each (token, head)'s split partials by their LSE.

Empty splits (LSE -inf) weigh exactly 0; a row whose splits are all empty gives output 0 and
LSE -inf, so nothing NaN reaches a later merge (decode context parallel).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mla_decode_stage2(
    part_out,
    part_lse,
    out,
    lse,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_plt,
    stride_plh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    num_splits,  # a runtime value: a constexpr compiled a kernel per split count (one per step size)
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    r = tl.arange(0, BLOCK_R)
    split_lse = tl.load(
        part_lse + tok * stride_plt + head * stride_plh + s, mask=s < num_splits, other=float("-inf")
    )
    top = tl.max(split_lse, 0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp(split_lse - top_safe)  # empty splits weigh exactly 0
    total = tl.sum(weight, 0)
    parts = tl.load(
        part_out + tok * stride_pt + head * stride_ph + s[:, None] * stride_ps + r[None, :],
        mask=(s[:, None] < num_splits) & (r[None, :] < RANK) & (weight[:, None] > 0.0),
        other=0.0,
    )
    denom = tl.where(total > 0.0, total, 1.0)
    merged = tl.sum(parts * weight[:, None], 0) / denom
    tl.store(out + tok * stride_ot + head * stride_oh + r, merged, mask=r < RANK)
    tl.store(
        lse + tok * stride_lt + head * stride_lh, tl.where(total > 0.0, top + tl.log(denom), float("-inf"))
    )

"""The two Triton stages of absorbed MLA decode (split-KV), dense and sparse top-k.

Stage 1: one program per (row group, block of rows, KV split). A row is one (query token, head)
pair; a dense row group is one request (all its q_len tokens x H heads, so every KV tile loaded
serves all of them), a sparse row group is one query token (its top-k keys are its own). Each
program streams its split of keys through an online softmax (base 2) and writes the normalized
partial output and its natural-log LSE. Stage 2 merges the splits by LSE. With one split, stage 1
writes the final output directly.
"""

from __future__ import annotations

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def mla_decode_stage1(
    q,
    cache,
    block_table,
    seq_lens,
    query_start_loc,
    token_req,
    topk,
    out,
    lse,
    kv_scale,
    sm_scale_log2,
    num_heads,
    topk_len,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_kt,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lt,
    stride_lh,
    stride_ls,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    SPLITS: tl.constexpr,
    SPARSE: tl.constexpr,
    CAUSAL: tl.constexpr,
    FP8: tl.constexpr,
    PRECISION: tl.constexpr,
):
    group = tl.program_id(0)
    split = tl.program_id(2)
    if SPARSE:
        req = tl.load(token_req + group)
        first_tok = group
        q_len = 1
    else:
        req = group
        first_tok = tl.load(query_start_loc + req)
        q_len = tl.load(query_start_loc + req + 1) - first_tok
    seq_len = tl.load(seq_lens + req)
    n_keys = topk_len if SPARSE else seq_len
    value_scale = tl.load(kv_scale) if FP8 else 1.0  # fp8 dequantization, folded into scores and output
    score_scale_log2 = sm_scale_log2 * value_scale

    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    tok_in_req = rows // num_heads
    head = rows % num_heads
    row_ok = tok_in_req < q_len
    tok = (first_tok + tok_in_req).to(tl.int64)
    last_visible = seq_len - q_len + tok_in_req  # causal: key positions <= the query's own

    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    # Column masks only where a width is not a power of two: a mask that varies along the row
    # would stop 16-byte vector loads of the KV tiles.
    r_ok = (r < RANK) if BLOCK_R != RANK else tl.full([BLOCK_R], 1, tl.int1)
    p_ok = (p < ROPE) if BLOCK_P != ROPE else tl.full([BLOCK_P], 1, tl.int1)
    q_row = q + tok * stride_qt + head * stride_qh
    q_nope = tl.load(q_row[:, None] + r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    q_pe = tl.load(q_row[:, None] + RANK + p[None, :], mask=row_ok[:, None] & p_ok[None, :], other=0.0)

    chunk = tl.cdiv(tl.cdiv(n_keys, SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, n_keys)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    table = block_table + req.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        in_split = n < end
        if SPARSE:
            pos = tl.load(topk + group.to(tl.int64) * stride_kt + n, mask=in_split, other=-1)
        else:
            pos = n
        key_ok = in_split & (pos >= 0) & (pos < seq_len)
        page = tl.load(table + pos // PAGE, mask=key_ok, other=0).to(tl.int64)
        key = cache + page * stride_cb + (pos % PAGE) * stride_cs
        if BLOCK_R == RANK:
            kv = tl.load(key[:, None] + r[None, :], mask=key_ok[:, None], other=0.0)
        else:
            kv = tl.load(key[:, None] + r[None, :], mask=key_ok[:, None] & r_ok[None, :], other=0.0)
        if BLOCK_P == ROPE:
            k_pe = tl.load(key[:, None] + RANK + p[None, :], mask=key_ok[:, None], other=0.0)
        else:
            k_pe = tl.load(key[:, None] + RANK + p[None, :], mask=key_ok[:, None] & p_ok[None, :], other=0.0)
        kv = kv.to(q.dtype.element_ty)  # fp8 -> activation dtype is exact; the scale is folded in
        k_pe = k_pe.to(q.dtype.element_ty)
        s = tl.dot(q_nope, tl.trans(kv), input_precision=PRECISION)
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)
        s = s * score_scale_log2
        visible = row_ok[:, None] & key_ok[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= last_visible[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet stay 0
        alpha = tl.exp2(m_i - m_safe)
        prob = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(kv.dtype), kv, input_precision=PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    denom = tl.where(seen, l_i, 1.0)
    result = tl.where(seen[:, None], acc * (value_scale / denom)[:, None], 0.0)
    row_lse = tl.where(seen, (m_i + tl.log2(denom)) * LN2, float("-inf"))
    o_row = out + tok * stride_ot + head * stride_oh + split * stride_os
    tl.store(o_row[:, None] + r[None, :], result, mask=row_ok[:, None] & r_ok[None, :])
    tl.store(lse + tok * stride_lt + head * stride_lh + split * stride_ls, row_lse, mask=row_ok)


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
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    r = tl.arange(0, BLOCK_R)
    split_lse = tl.load(
        part_lse + tok * stride_plt + head * stride_plh + s, mask=s < SPLITS, other=float("-inf")
    )
    top = tl.max(split_lse, 0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp(split_lse - top_safe)  # empty splits weigh exactly 0
    total = tl.sum(weight, 0)
    parts = tl.load(
        part_out + tok * stride_pt + head * stride_ph + s[:, None] * stride_ps + r[None, :],
        mask=(s[:, None] < SPLITS) & (r[None, :] < RANK) & (weight[:, None] > 0.0),
        other=0.0,
    )
    denom = tl.where(total > 0.0, total, 1.0)
    merged = tl.sum(parts * weight[:, None], 0) / denom
    tl.store(out + tok * stride_ot + head * stride_oh + r, merged, mask=r < RANK)
    tl.store(
        lse + tok * stride_lt + head * stride_lh, tl.where(total > 0.0, top + tl.log(denom), float("-inf"))
    )

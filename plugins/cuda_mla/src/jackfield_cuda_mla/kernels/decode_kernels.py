"""Stage 1 of absorbed MLA decode (split-KV), dense and sparse top-k.

Stage 1: one program per (row group, block of rows, KV split). A row is one (query token, head)
pair; a dense row group is one request (all its q_len tokens x H heads, so every KV tile loaded
serves all of them), a sparse row group is one query token (its top-k keys are its own). Each
program streams its split of keys through an online softmax (base 2) and writes the normalized
partial output and its natural-log LSE. Stage 2 (decode_merge.py) merges the splits by LSE.
With one split, stage 1 writes the final output directly.
"""

from __future__ import annotations

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _gather_keys(
    cache,
    table,
    topk_row,
    n0,
    end,
    seq_len,
    r,
    p,
    r_ok,
    p_ok,
    stride_cb,
    stride_cs,
    RANK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    SPARSE: tl.constexpr,
    MASK_R: tl.constexpr,
    MASK_P: tl.constexpr,
):
    """Keys n0 .. n0 + BLOCK_N of this split through per-key page pointers; missing keys read 0."""
    n = n0 + tl.arange(0, BLOCK_N)
    in_split = n < end
    if SPARSE:
        pos = tl.load(topk_row + n, mask=in_split, other=-1)
    else:
        pos = n
    key_ok = in_split & (pos >= 0) & (pos < seq_len)
    page = tl.load(table + pos // PAGE, mask=key_ok, other=0).to(tl.int64)
    key = cache + page * stride_cb + (pos % PAGE) * stride_cs
    # Column masks only where a width is not a power of two: a mask that varies along the row
    # would stop 16-byte vector loads.
    kv_mask = key_ok[:, None] & r_ok[None, :] if MASK_R else key_ok[:, None]
    pe_mask = key_ok[:, None] & p_ok[None, :] if MASK_P else key_ok[:, None]
    kv = tl.load(key[:, None] + r[None, :], mask=kv_mask, other=0.0)
    k_pe = tl.load(key[:, None] + RANK + p[None, :], mask=pe_mask, other=0.0)
    return pos, key_ok, kv, k_pe


@triton.jit
def _attend(
    q_nope,
    q_pe,
    kv,
    k_pe,
    pos,
    key_ok,
    row_ok,
    last_visible,
    m_i,
    l_i,
    acc,
    score_scale_log2,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    SWAP: tl.constexpr,
):
    """One online-softmax step (base 2) over a key tile; returns the new (max, sum, accumulator).

    SWAP: keys are the M dimension of both products (q_nope / q_pe come transposed, [D, rows];
    acc is [R, rows]). Hopper's wgmma needs 64 rows a warpgroup, which a tile of 16-32 query rows
    cannot give, so without SWAP the few-rows case runs on mma.sync with the KV tile staged through
    registers; with SWAP the 64-key tile is the M operand and the query rows are N.
    """
    kv = kv.to(q_nope.dtype)  # fp8 -> activation dtype is exact; the scale is folded in
    k_pe = k_pe.to(q_pe.dtype)
    if SWAP:
        s = tl.dot(kv, q_nope, input_precision=PRECISION)
        s += tl.dot(k_pe, q_pe, input_precision=PRECISION)
        s = s * score_scale_log2
        visible = key_ok[:, None] & row_ok[None, :]
        if CAUSAL:
            visible = visible & (pos[:, None] <= last_visible[None, :])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet stay 0
        alpha = tl.exp2(m_i - m_safe)
        prob = tl.exp2(s - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(prob, 0)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(kv), prob.to(kv.dtype), input_precision=PRECISION)
    else:
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
    return m_new, l_i, acc


@triton.jit
def mla_decode_stage1(
    q,
    cache,
    kv_desc,
    pe_desc,
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
    num_splits,  # a runtime value: a constexpr compiled a kernel per split count (one per step size)
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    SPARSE: tl.constexpr,
    CAUSAL: tl.constexpr,
    FP8: tl.constexpr,
    PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,
    TMA: tl.constexpr,
    SWAP: tl.constexpr,
):
    # Row blocks of one group are neighbouring program ids, so they run at the same time and
    # share each KV tile through L2 instead of reading it from memory once per row block.
    group = tl.program_id(1)
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

    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    tok_in_req = rows // num_heads
    head = rows % num_heads
    row_ok = tok_in_req < q_len
    tok = (first_tok + tok_in_req).to(tl.int64)
    last_visible = seq_len - q_len + tok_in_req  # causal: key positions <= the query's own

    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    r_ok = r < RANK
    p_ok = p < ROPE
    q_row = q + tok * stride_qt + head * stride_qh
    q_nope = tl.load(q_row[:, None] + r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    q_pe = tl.load(q_row[:, None] + RANK + p[None, :], mask=row_ok[:, None] & p_ok[None, :], other=0.0)

    chunk = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, n_keys)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SWAP:
        q_nope = tl.trans(q_nope)
        q_pe = tl.trans(q_pe)
        acc = tl.zeros([BLOCK_R, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    table = block_table + req.to(tl.int64) * stride_bt
    topk_row = topk + group.to(tl.int64) * stride_kt
    MASK_R: tl.constexpr = BLOCK_R != RANK
    MASK_P: tl.constexpr = BLOCK_P != ROPE
    tail = start
    if TMA:
        # Dense, PAGE % BLOCK_N == 0: a tile is BLOCK_N contiguous rows of one page, copied by the
        # tensor memory accelerator. Only whole tiles below seq_len (rows past it may hold
        # anything, NaN included); the partial last tile goes through the gather path below.
        tail = tl.maximum(end // BLOCK_N * BLOCK_N, start)
        all_keys = tl.full([BLOCK_N], 1, tl.int1)
        for n0 in range(start, tail, BLOCK_N):
            row = tl.load(table + n0 // PAGE) * PAGE + n0 % PAGE
            kv = kv_desc.load([row, 0])
            k_pe = pe_desc.load([row, RANK])
            pos = n0 + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _attend(
                q_nope,
                q_pe,
                kv,
                k_pe,
                pos,
                all_keys,
                row_ok,
                last_visible,
                m_i,
                l_i,
                acc,
                score_scale_log2,
                CAUSAL,
                PRECISION,
                SWAP,
            )
    if PREFETCH:
        # Registers double-buffer the tiles: tile i + 1 is in flight while tile i is computed
        # (the converted fp8 tile is not a plain shared-memory operand, so the compiler's own
        # pipelining does not cover it).
        pos, key_ok, kv, k_pe = _gather_keys(
            cache,
            table,
            topk_row,
            tail,
            end,
            seq_len,
            r,
            p,
            r_ok,
            p_ok,
            stride_cb,
            stride_cs,
            RANK,
            BLOCK_N,
            PAGE,
            SPARSE,
            MASK_R,
            MASK_P,
        )
        for n0 in range(tail, end, BLOCK_N):
            next_pos, next_ok, next_kv, next_pe = _gather_keys(
                cache,
                table,
                topk_row,
                n0 + BLOCK_N,
                end,
                seq_len,
                r,
                p,
                r_ok,
                p_ok,
                stride_cb,
                stride_cs,
                RANK,
                BLOCK_N,
                PAGE,
                SPARSE,
                MASK_R,
                MASK_P,
            )
            m_i, l_i, acc = _attend(
                q_nope,
                q_pe,
                kv,
                k_pe,
                pos,
                key_ok,
                row_ok,
                last_visible,
                m_i,
                l_i,
                acc,
                score_scale_log2,
                CAUSAL,
                PRECISION,
                SWAP,
            )
            pos, key_ok, kv, k_pe = next_pos, next_ok, next_kv, next_pe
    else:
        for n0 in range(tail, end, BLOCK_N):
            pos, key_ok, kv, k_pe = _gather_keys(
                cache,
                table,
                topk_row,
                n0,
                end,
                seq_len,
                r,
                p,
                r_ok,
                p_ok,
                stride_cb,
                stride_cs,
                RANK,
                BLOCK_N,
                PAGE,
                SPARSE,
                MASK_R,
                MASK_P,
            )
            m_i, l_i, acc = _attend(
                q_nope,
                q_pe,
                kv,
                k_pe,
                pos,
                key_ok,
                row_ok,
                last_visible,
                m_i,
                l_i,
                acc,
                score_scale_log2,
                CAUSAL,
                PRECISION,
                SWAP,
            )

    if SWAP:
        acc = tl.trans(acc)
    seen = l_i > 0.0
    denom = tl.where(seen, l_i, 1.0)
    result = tl.where(seen[:, None], acc * (value_scale / denom)[:, None], 0.0)
    row_lse = tl.where(seen, (m_i + tl.log2(denom)) * LN2, float("-inf"))
    o_row = out + tok * stride_ot + head * stride_oh + split * stride_os
    tl.store(o_row[:, None] + r[None, :], result, mask=row_ok[:, None] & r_ok[None, :])
    tl.store(lse + tok * stride_lt + head * stride_lh + split * stride_ls, row_lse, mask=row_ok)

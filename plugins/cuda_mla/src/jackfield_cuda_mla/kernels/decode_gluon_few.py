"""Dense MLA decode for few rows (<= 32 query rows a request, e.g. H=16 x q_len 1-2) in Gluon, Hopper.

Same contract as `mla_decode_stage1` (dense): one program per (request, KV split) holds every row
of the request, streams its keys through a base-2 online softmax and writes the normalized
output and natural-log LSE (or split partials for `mla_decode_stage2`).

Why a hand-scheduled kernel: with 16-32 rows the work is memory-bound (~30 FLOP per byte), so what
counts is bytes in flight per SM. Both products are swapped so that the 64 keys of a tile are
wgmma's M (it needs 64) and the rows are N: S^T[keys, rows] = K . Q^T and
O^T[values, rows] += V^T . P^T, with K, V^T, Q^T and P^T all read by wgmma from shared memory.
Shared memory is a ring of half tiles (64 keys x 256 value columns) plus a ring of rope boxes
(64 keys x 64), filled by TMA. A slot is refilled as soon as the wgmma that reads it has completed
(V halves after their PV product, rope boxes after QK), so about 1.5-2.5 tiles stay in flight,
not 1-2 as with whole-tile stages. The block table is read one scalar per TMA (L1 hits after the
first).

Rows past seq_len in the last page may hold NaN: they are zeroed in shared memory before any
product reads them (rewritten in place). An fp8 cache runs decode_gluon_fp8's kernel, which shares
this module's query staging, softmax and output helpers.
"""

from __future__ import annotations

import functools

import torch
from jackfield.ops.launch import DirectLauncher
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from jackfield_cuda_mla.kernels.checks import FP8, cache_is_one_matrix
from jackfield_cuda_mla.kernels.gluon_hopper import cta_barrier, smem_layout, tma_load

TILE_KEYS = 64  # keys per tile: wgmma's M
BLOCK_N = gl.constexpr(TILE_KEYS)
LN2 = gl.constexpr(0.6931471805599453)
# Probabilities (<= 1) go to f16 scaled by 2^15: below 2^-14 f16 loses bits and below 2^-24 flushes
# them to 0 while the denominator keeps them; scaled, bits are lost only below 2^-29 (the output's
# normalization takes the factor back out). bf16 has the exponent range and needs no scale.
P_SCALE_F16 = gl.constexpr(32768.0)


@gluon.jit
def _issue_unit(
    nope_desc,
    rope_desc,
    nope_ring,
    rope_ring,
    ready,
    u,
    row,
    RANK: gl.constexpr,
    ROPE: gl.constexpr,
    HALF: gl.constexpr,
    NOPE_SLOTS: gl.constexpr,
    ROPE_SLOTS: gl.constexpr,
):
    """TMA load of ring unit u, value half u % 2 of the tile whose first key is cache row `row`
    (half 0 brings the tile's rope box along, on the same barrier)."""
    ELEM_BYTES: gl.constexpr = nope_desc.dtype.primitive_bitwidth // 8
    HALF_BYTES: gl.constexpr = BLOCK_N * HALF * ELEM_BYTES
    ROPE_BYTES: gl.constexpr = BLOCK_N * ROPE * ELEM_BYTES
    slot = u % NOPE_SLOTS
    bar = ready.index(slot)
    if u % 2 == 0:
        mbarrier.expect(bar, HALF_BYTES + ROPE_BYTES)
        tma_load(nope_desc, [row, 0], bar, nope_ring.index(slot))
        tma_load(rope_desc, [row, RANK], bar, rope_ring.index((u // 2) % ROPE_SLOTS))
    else:
        mbarrier.expect(bar, HALF_BYTES)
        tma_load(nope_desc, [row, HALF], bar, nope_ring.index(slot))


@gluon.jit
def _tile_row(table, start, tile, PAGE: gl.constexpr):
    """Cache row of the tile's first key (one block-table read; L1 hits after a page's first)."""
    n0 = start + tile * BLOCK_N
    return gl.load(table + n0 // PAGE) * PAGE + n0 % PAGE


@gluon.jit
def _issue_units(
    nope_desc,
    rope_desc,
    nope_ring,
    rope_ring,
    ready,
    table,
    start,
    first,
    limit,
    RANK: gl.constexpr,
    ROPE: gl.constexpr,
    HALF: gl.constexpr,
    PAGE: gl.constexpr,
    NOPE_SLOTS: gl.constexpr,
    ROPE_SLOTS: gl.constexpr,
):
    """TMA loads of ring units first .. limit - 1; unit u is value half u % 2 of tile u // 2."""
    for u in range(first, limit):
        row = _tile_row(table, start, u // 2, PAGE)
        _issue_unit(
            nope_desc,
            rope_desc,
            nope_ring,
            rope_ring,
            ready,
            u,
            row,
            RANK,
            ROPE,
            HALF,
            NOPE_SLOTS,
            ROPE_SLOTS,
        )


@gluon.jit
def _stage_keys(box, valid, layout: gl.constexpr):
    """A [BLOCK_N, W] key box in shared memory with its key rows >= valid zeroed (they may hold
    NaN), in place."""
    x = box.load(layout)
    if valid < BLOCK_N:
        keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        x = gl.where((keys < valid)[:, None], x, gl.zeros_like(x))
    box.store(x)


@gluon.jit
def _max_abs(x):
    return gl.max(gl.max(gl.abs(x.to(gl.float32)), axis=1), axis=0)


@gluon.jit
def natural_order(index):
    """Column order of the query and output as stored: the tensor's own (see DIM_ORDER below)."""
    return index


@gluon.jit
def _load_query(
    q,
    tok,
    head,
    row_ok,
    col0,
    WIDTH: gl.constexpr,
    stride_qt,
    stride_qh,
    layout: gl.constexpr,
    DIM_ORDER: gl.constexpr,
):
    rows_ptr = q + tok * stride_qt + head * stride_qh + col0
    cols = DIM_ORDER(gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout)))
    return gl.load(rows_ptr[:, None] + cols[None, :], mask=row_ok[:, None], other=0.0)


@gluon.jit
def _store_half(
    out_rows, value, row_ok, col0, HALF: gl.constexpr, layout: gl.constexpr, DIM_ORDER: gl.constexpr
):
    """value [HALF, rows] (transposed output; its row i is column DIM_ORDER(i)) -> out[row, col0 + c]."""
    cols = col0 + DIM_ORDER(gl.arange(0, HALF, layout=gl.SliceLayout(1, layout)))
    gl.store(out_rows[None, :] + cols[:, None], value.to(out_rows.dtype.element_ty), mask=row_ok[None, :])


@gluon.jit
def _stage_query(
    q,
    q_lo_buf,
    q_hi_buf,
    q_pe_buf,
    first_tok,
    q_len,
    num_heads,
    stride_qt,
    stride_qh,
    score_scale_log2,
    RANK: gl.constexpr,
    ROPE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    TO_F16: gl.constexpr,
    DIM_ORDER: gl.constexpr = natural_order,
):
    """The request's query rows into the wgmma operand buffers; returns the score scale.
    Buffer column i holds query dimension DIM_ORDER(i) (a kernel that reads keys in another order).

    TO_F16 (fp8 caches, whose tiles become f16): the bf16 query in f16, exactly: scaled by a power
    of two that puts its largest element in [2^13, 2^15) (below f16's 65504; bf16's 8 mantissa
    bits fit f16's 11). Elements below 2^-28 of that largest one lose bits. The scores undo the
    scale.
    """
    HALF: gl.constexpr = RANK // 2
    NUM_WARPS: gl.constexpr = gl.num_warps()
    # Register layouts for the global loads: 16-byte vectors.
    q_half_regs: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NUM_WARPS, 1], [1, 0])
    q_rope_regs: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // ROPE, ROPE // 8], [NUM_WARPS, 1], [1, 0])
    # Row r of the group is (token r // H, head r % H).
    rows_h = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_half_regs))
    tok_h = (first_tok + rows_h // num_heads).to(gl.int64)
    ok_h = rows_h < q_len * num_heads
    head_h = rows_h % num_heads
    q_lo_val = _load_query(q, tok_h, head_h, ok_h, 0, HALF, stride_qt, stride_qh, q_half_regs, DIM_ORDER)
    q_hi_val = _load_query(q, tok_h, head_h, ok_h, HALF, HALF, stride_qt, stride_qh, q_half_regs, DIM_ORDER)
    rows_p = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_rope_regs))
    tok_p = (first_tok + rows_p // num_heads).to(gl.int64)
    ok_p = rows_p < q_len * num_heads
    head_p = rows_p % num_heads
    q_pe_val = _load_query(q, tok_p, head_p, ok_p, RANK, ROPE, stride_qt, stride_qh, q_rope_regs, DIM_ORDER)
    if TO_F16:
        q_max = gl.maximum(_max_abs(q_lo_val), gl.maximum(_max_abs(q_hi_val), _max_abs(q_pe_val)))
        q_exp = gl.where(q_max > 0.0, 13.0 - gl.floor(gl.log2(q_max)), 0.0)
        q_exp = gl.minimum(gl.maximum(q_exp, -126.0), 127.0).to(gl.int32)
        q_scale = ((q_exp + 127) << 23).to(gl.float32, bitcast=True)  # 2^q_exp, exactly
        q_lo_val = (q_lo_val.to(gl.float32) * q_scale).to(gl.float16)
        q_hi_val = (q_hi_val.to(gl.float32) * q_scale).to(gl.float16)
        q_pe_val = (q_pe_val.to(gl.float32) * q_scale).to(gl.float16)
        score_scale_log2 = score_scale_log2 / q_scale
    q_lo_buf.index(0).store(q_lo_val)
    q_hi_buf.index(0).store(q_hi_val)
    q_pe_buf.index(0).store(q_pe_val)
    return score_scale_log2


@gluon.jit
def _masked_scores(
    s, n0, end, row_ok, last_visible, score_scale_log2, CAUSAL: gl.constexpr, key_vec: gl.constexpr
):
    """Score tile S^T [keys, rows] in base-2 units; keys at or past `end`, and past a row's causal
    limit, at -inf."""
    pos = n0 + gl.arange(0, BLOCK_N, layout=key_vec)
    visible = (pos < end)[:, None] & row_ok[None, :]
    if CAUSAL:
        visible = visible & (pos[:, None] <= last_visible[None, :])
    return gl.where(visible, s * score_scale_log2, float("-inf"))


@gluon.jit
def _softmax_update(s, m_i):
    """Base-2 online softmax over masked scores S^T [keys, rows]: (probabilities, rescale factor,
    new max); the caller keeps the sums."""
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet stay 0
    alpha = gl.exp2(m_i - m_safe)
    prob = gl.exp2(s - m_safe[None, :])
    return prob, alpha, m_new


@gluon.jit
def _softmax_step(
    s, n0, end, row_ok, last_visible, m_i, score_scale_log2, CAUSAL: gl.constexpr, key_vec: gl.constexpr
):
    """_softmax_update of _masked_scores."""
    s = _masked_scores(s, n0, end, row_ok, last_visible, score_scale_log2, CAUSAL, key_vec)
    return _softmax_update(s, m_i)


@gluon.jit
def _attend_tile(
    k_lo,
    k_hi,
    k_pe,
    q_lo,
    q_hi,
    q_pe,
    p_smem,
    s_zero,
    n0,
    end,
    row_ok,
    last_visible,
    m_i,
    l_i,
    acc_lo,
    acc_hi,
    score_scale_log2,
    CAUSAL: gl.constexpr,
    key_vec: gl.constexpr,
    P_SCALE: gl.constexpr,
):
    """One tile, swapped: S^T = K . Q^T, the softmax step, P^T (times P_SCALE) through shared
    memory, O^T += V^T . P^T; both products complete before it returns. -> (max, sum, O^T halves)"""
    s = warpgroup_mma(k_pe, q_pe.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma(k_lo, q_lo.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma(k_hi, q_hi.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s])
    prob, alpha, m_i = _softmax_step(s, n0, end, row_ok, last_visible, m_i, score_scale_log2, CAUSAL, key_vec)
    l_i = l_i * alpha + gl.sum(prob, axis=0)
    acc_lo = acc_lo * alpha[None, :]
    acc_hi = acc_hi * alpha[None, :]
    p_smem.store((prob * P_SCALE).to(p_smem.dtype))
    fence_async_shared()
    cta_barrier()
    pv_lo = warpgroup_mma(k_lo.permute((1, 0)), p_smem, acc_lo, is_async=True)
    pv_hi = warpgroup_mma(k_hi.permute((1, 0)), p_smem, acc_hi, is_async=True)
    acc_lo, acc_hi = warpgroup_mma_wait(0, deps=[pv_lo, pv_hi])
    return m_i, l_i, acc_lo, acc_hi


@gluon.jit
def _write_output(
    acc_lo,
    acc_hi,
    m_i,
    l_i,
    value_scale,
    rows,
    row_ok,
    first_tok,
    num_heads,
    split,
    out,
    lse,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lt,
    stride_lh,
    stride_ls,
    HALF: gl.constexpr,
    P_SCALE: gl.constexpr,
    mma: gl.constexpr,
    DIM_ORDER: gl.constexpr = natural_order,
):
    """The normalized output (times value_scale; P was stored times P_SCALE) and the natural-log
    LSE of every row; rows that saw no key get exactly 0 and -inf. Accumulator row i is output
    column DIM_ORDER(i) of each half."""
    seen = l_i > 0.0
    denom = gl.where(seen, l_i, 1.0)
    norm = gl.where(seen, value_scale / (denom * P_SCALE), 0.0)
    tok = (first_tok + rows // num_heads).to(gl.int64)
    head = rows % num_heads
    out_rows = out + tok * stride_ot + head * stride_oh + split * stride_os
    _store_half(out_rows, acc_lo * norm[None, :], row_ok, 0, HALF, mma, DIM_ORDER)
    _store_half(out_rows, acc_hi * norm[None, :], row_ok, HALF, HALF, mma, DIM_ORDER)
    row_lse = gl.where(seen, (m_i + gl.log2(denom)) * LN2, float("-inf"))
    gl.store(lse + tok * stride_lt + head * stride_lh + split * stride_ls, row_lse, mask=row_ok)


@gluon.jit
def mla_decode_few_rows(
    q,
    nope_desc,
    rope_desc,
    block_table,
    seq_lens,
    query_start_loc,
    out,
    lse,
    sm_scale_log2,
    num_heads,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lt,
    stride_lh,
    stride_ls,
    num_splits,  # a runtime value: a constexpr compiled a kernel per split count (one per step size)
    RANK: gl.constexpr,
    ROPE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    PAGE: gl.constexpr,
    CAUSAL: gl.constexpr,
    NOPE_SLOTS: gl.constexpr,
    ROPE_SLOTS: gl.constexpr,
):
    """bf16 cache: one warpgroup waits for each tile's ring units and runs QK, softmax and PV
    straight from the TMA buffers."""
    HALF: gl.constexpr = RANK // 2
    NUM_WARPS: gl.constexpr = gl.num_warps()
    # Accumulators S^T [keys, rows] and O^T halves [HALF, rows]: one warpgroup, rows as wgmma's N.
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_M, 16]
    )
    key_vec: gl.constexpr = gl.SliceLayout(1, mma)
    row_vec: gl.constexpr = gl.SliceLayout(0, mma)
    key_half_regs: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [NUM_WARPS, 1], [1, 0])

    req = gl.program_id(0)
    split = gl.program_id(1)
    first_tok = gl.load(query_start_loc + req)
    q_len = gl.load(query_start_loc + req + 1) - first_tok
    seq_len = gl.load(seq_lens + req)
    chunk = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = gl.minimum(start + chunk, seq_len)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    table = block_table + req.to(gl.int64) * stride_bt

    # Shared memory: query halves and rope (wgmma B operands, K-major), P^T, the TMA rings.
    q_half_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], gl.bfloat16)
    q_rope_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, ROPE], gl.bfloat16)
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], gl.bfloat16)
    # Single buffers with a leading axis of 1: see `here` in the loop.
    q_lo_buf = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_M, HALF], q_half_smem)
    q_hi_buf = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_M, HALF], q_half_smem)
    q_pe_buf = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_M, ROPE], q_rope_smem)
    p_buf = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, BLOCK_M], p_smem_layout)
    nope_ring = gl.allocate_shared_memory(gl.bfloat16, [NOPE_SLOTS, BLOCK_N, HALF], nope_desc.layout)
    rope_ring = gl.allocate_shared_memory(gl.bfloat16, [ROPE_SLOTS, BLOCK_N, ROPE], rope_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NOPE_SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NOPE_SLOTS):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()

    # The ring's first units go out before the query is loaded. Later, once the first 2t + 2
    # units are read, units up to 2t + 2 + NOPE_SLOTS are in the ring. (Computed, not carried
    # through the loop: Triton 3.6 dropped such a loop-carried scalar, reissuing units.)
    _issue_units(
        nope_desc,
        rope_desc,
        nope_ring,
        rope_ring,
        ready,
        table,
        start,
        0,
        gl.minimum(NOPE_SLOTS, 2 * n_tiles),
        RANK,
        ROPE,
        HALF,
        PAGE,
        NOPE_SLOTS,
        ROPE_SLOTS,
    )
    score_scale_log2 = _stage_query(
        q,
        q_lo_buf,
        q_hi_buf,
        q_pe_buf,
        first_tok,
        q_len,
        num_heads,
        stride_qt,
        stride_qh,
        sm_scale_log2,
        RANK,
        ROPE,
        BLOCK_M,
        False,
    )
    fence_async_shared()
    cta_barrier()

    rows = gl.arange(0, BLOCK_M, layout=row_vec)
    row_ok = rows < q_len * num_heads
    last_visible = seq_len - q_len + rows // num_heads  # causal: keys at positions <= the row's own
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_vec)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_vec)
    acc_lo = gl.zeros([HALF, BLOCK_M], gl.float32, layout=mma)
    acc_hi = gl.zeros([HALF, BLOCK_M], gl.float32, layout=mma)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)

    # Every wgmma is waited for inside the iteration that issues it: ptxas serializes all wgmma
    # when accumulator registers may be defined while one is in flight, which a wait after the
    # loop (merging with the zero-trip path's initial accumulators) would allow.
    for t in range(n_tiles):
        n0 = start + t * BLOCK_N
        valid = end - n0  # keys of this tile below the split's end (< BLOCK_N only in the last)
        # Always 0 (valid >= 1), but not provably so: the wgmma descriptors of the single buffers
        # are then built next to their use instead of being hoisted out of the loop, where
        # 40-70 of them (2 registers each) spilled.
        here = gl.minimum(valid - 1, 0)
        q_lo = q_lo_buf.index(here)
        q_hi = q_hi_buf.index(here)
        q_pe = q_pe_buf.index(here)
        p_smem = p_buf.index(here)
        slot_lo = (2 * t) % NOPE_SLOTS
        slot_hi = (2 * t + 1) % NOPE_SLOTS
        k_lo = nope_ring.index(slot_lo)
        k_hi = nope_ring.index(slot_hi)
        k_pe = rope_ring.index(t % ROPE_SLOTS)
        mbarrier.wait(ready.index(slot_lo), ((2 * t) // NOPE_SLOTS) & 1)
        mbarrier.wait(ready.index(slot_hi), ((2 * t + 1) // NOPE_SLOTS) & 1)
        if valid < BLOCK_N:
            # Last, partial tile: V rows past the end would turn 0-weights into NaN in PV.
            _stage_keys(k_lo, valid, key_half_regs)
            _stage_keys(k_hi, valid, key_half_regs)
            fence_async_shared()
            cta_barrier()
        m_i, l_i, acc_lo, acc_hi = _attend_tile(
            k_lo,
            k_hi,
            k_pe,
            q_lo,
            q_hi,
            q_pe,
            p_smem,
            s_zero,
            n0,
            end,
            row_ok,
            last_visible,
            m_i,
            l_i,
            acc_lo,
            acc_hi,
            score_scale_log2,
            CAUSAL,
            key_vec,
            1.0,
        )
        _issue_units(  # tile t's halves are read: their slots take the next units
            nope_desc,
            rope_desc,
            nope_ring,
            rope_ring,
            ready,
            table,
            start,
            gl.minimum(2 * t + NOPE_SLOTS, 2 * n_tiles),
            gl.minimum(2 * t + 2 + NOPE_SLOTS, 2 * n_tiles),
            RANK,
            ROPE,
            HALF,
            PAGE,
            NOPE_SLOTS,
            ROPE_SLOTS,
        )

    for i in gl.static_range(NOPE_SLOTS):
        mbarrier.invalidate(ready.index(i))
    _write_output(
        acc_lo,
        acc_hi,
        m_i,
        l_i,
        1.0,
        rows,
        row_ok,
        first_tok,
        num_heads,
        split,
        out,
        lse,
        stride_ot,
        stride_oh,
        stride_os,
        stride_lt,
        stride_lh,
        stride_ls,
        HALF,
        1.0,
        mma,
    )


# Shared memory a program may use on sm_90 (227 KB), less a reserve for the compiler's reduction
# scratch and the barriers.
SMEM_BYTES = 227 * 1024 - 3 * 1024
NUM_WARPS = 4  # one warpgroup
FEW_ROWS = 32  # most rows a program holds (wgmma N); more rows go to the Triton kernel


def block_rows(rows_per_group: int) -> int:
    """wgmma's N for this many query rows a request: 16, else FEW_ROWS."""
    return 16 if rows_per_group <= 16 else FEW_ROWS


@functools.cache  # every call asks for one of a few plans
def ring_slots(block_m: int, rank: int, rope: int) -> tuple[int, int]:
    """(value-half slots, rope slots) of a bf16 cache that fit next to the query and P^T.

    A rope slot per tile that can be in flight: the half ring holds ceil(slots / 2) tiles.
    """
    fixed = block_m * (rank + rope) * 2 + TILE_KEYS * block_m * 2
    half, box = TILE_KEYS * rank // 2 * 2, TILE_KEYS * rope * 2
    slots = 2
    while fixed + (slots + 1) * half + (slots + 2) // 2 * box <= SMEM_BYTES:
        slots += 1
    return slots, (slots + 1) // 2


def few_rows_shapes_fit(
    query: torch.Tensor, kv_cache: torch.Tensor, rows_per_group: int, kv_lora_rank: int
) -> bool:
    """bf16 queries over a bf16 cache (this module's kernel) or an fp8 one (decode_gluon_fp8's),
    the DeepSeek widths the kernels were tuned and tested for (512 + 64), pages of whole 64-key
    tiles laid out back to back (one 2-D TMA view of the cache, 16-byte aligned), at most 32 rows a
    request."""
    page, width = kv_cache.shape[1], kv_cache.shape[2]
    return (
        query.dtype == torch.bfloat16
        and kv_cache.dtype in (torch.bfloat16, FP8)
        and kv_lora_rank == 512
        and width - kv_lora_rank == 64
        and rows_per_group <= FEW_ROWS
        and page % TILE_KEYS == 0
        and cache_is_one_matrix(kv_cache)
    )


def few_rows_arguments(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    stride_os: int,
    stride_ls: int,
    sm_scale_log2: float,
    splits: int,
    kv_lora_rank: int,
) -> tuple[tuple[int, int], tuple]:
    """(grid, runtime arguments) of a few-rows kernel: a program a (request, split); the cache as two
    TMA views, value halves and rope boxes of 64 keys."""
    num_blocks, page, width = kv_cache.shape
    rope = width - kv_lora_rank
    kv_dtype = gl.float8e4nv if kv_cache.dtype == FP8 else gl.bfloat16
    shape, strides = [num_blocks * page, width], [kv_cache.stride(1), 1]
    half_box, rope_box = [TILE_KEYS, kv_lora_rank // 2], [TILE_KEYS, rope]
    nope_desc = TensorDescriptor(kv_cache, shape, strides, half_box, smem_layout(tuple(half_box), kv_dtype))
    rope_desc = TensorDescriptor(kv_cache, shape, strides, rope_box, smem_layout(tuple(rope_box), kv_dtype))
    kernel_args = (
        query,
        nope_desc,
        rope_desc,
        block_table,
        seq_lens,
        query_start_loc,
        part_out,
        part_lse,
        sm_scale_log2,
        query.shape[1],
        query.stride(0),
        query.stride(1),
        block_table.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        stride_os,
        part_lse.stride(0),
        part_lse.stride(1),
        stride_ls,
    )
    return (seq_lens.numel(), splits), kernel_args


def launch_few_rows(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    stride_os: int,
    stride_ls: int,
    sm_scale_log2: float,
    rows_per_group: int,
    splits: int,
    causal: bool,
    kv_lora_rank: int,
) -> None:
    """Stage 1 over (request, split) for a bf16 cache: the final output when splits == 1, else split
    partials."""
    page, width = kv_cache.shape[1], kv_cache.shape[2]
    rope = width - kv_lora_rank
    block_m = block_rows(rows_per_group)
    nope_slots, rope_slots = ring_slots(block_m, kv_lora_rank, rope)
    grid, kernel_args = few_rows_arguments(
        query,
        kv_cache,
        block_table,
        seq_lens,
        query_start_loc,
        part_out,
        part_lse,
        stride_os,
        stride_ls,
        sm_scale_log2,
        splits,
        kv_lora_rank,
    )
    tiles = dict(
        RANK=kv_lora_rank,
        ROPE=rope,
        BLOCK_M=block_m,
        PAGE=page,
        num_splits=splits,
        CAUSAL=causal,
        NOPE_SLOTS=nope_slots,
        ROPE_SLOTS=rope_slots,
        num_warps=NUM_WARPS,
    )
    _launch(grid, *kernel_args, **tiles)


# Triton's per-call dispatch costs more host time than the kernel takes on the GPU (jackfield.ops.launch)
_launch = DirectLauncher(mla_decode_few_rows)

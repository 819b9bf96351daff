"""fp8 cache, <= 32 rows a request, on Hopper: the keys and values reach the tensor cores from
registers, converted there, so no f16 copy of a tile ever sits in shared memory.

Its predecessor (sessions 5-7) had a converter warpgroup turn each tile into one of two f16 tiles
(144 KB of the 227) that the consumers then read: a tile's conversion and its products were chained
through those two buffers, and the ring kept only 1.5 fp8 tiles in flight (H200, B128 H16 S4096:
138.7 us, bf16's 146.7; this kernel: 89.0). Here wgmma takes its A operand from registers:
- QK: S^T = K . Q^T, A = K [64 keys, 128 dims] (the rope: 64) loaded from the fp8 ring and
  converted to f16 in registers, one group's products in flight while the next is converted;
- PV: O^T = V^T . P^T a quarter of the values at a time (one quarter's products in flight while
  the next is converted), A = V^T [128 dims, 64 keys] from the same ring slot.
Both loads read runs of consecutive bytes (16 a key, 4 a value) and are relabelled in registers
into wgmma's layout (see KEY_CHUNK_LOAD). Shared memory holds the f16 query, one P^T per consumer
and a ring of whole fp8 tiles (5: 180 KB in flight). A one-warp producer issues the TMA loads
into the ring (block-table rows read ahead of its waits); two consumer warpgroups take alternate
tiles with their own online softmax and merge at the end, consumer 1's partial left in the ring
slot of its last tile (no later tile reuses it).

The consumers bound the kernel, and its time follows the instructions a consumer issues a tile
(H200: ~0.1 us a kernel per instruction of the tile loop; PERF_NOTES round 8): a tile where no
row's max moved skips the accumulators' rescale, a tile every row sees whole skips the causal and
length masks, and a split's last tile zeroes its stale keys in the ring once instead of every tile
masking its value operands.
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

from jackfield_cuda_mla.kernels.decode_gluon_few import (
    BLOCK_N,
    NUM_WARPS,
    P_SCALE_F16,
    SMEM_BYTES,
    _masked_scores,
    _softmax_update,
    _stage_query,
    _tile_row,
    _write_output,
    block_rows,
    few_rows_arguments,
)
from jackfield_cuda_mla.kernels.gluon_hopper import cta_barrier, smem_reinterpret, tma_load

CHUNK = gl.constexpr(64)  # dimensions of K a relabelled load (QK wgmma groups take two: 32 registers)
CONSUMER_WARPS = gl.constexpr(4)
PRODUCER_WARPS = gl.constexpr(1)
CONSUMER_REGS = gl.constexpr(232)  # the worker consumer's registers a thread (setmaxnreg)
PRODUCER_REGS = gl.constexpr(40)


@gluon.jit
def _ready_barrier(ready, t, SLOTS: gl.constexpr):
    """(barrier, parity) that says tile t landed in its ring slot. A slot's tiles alternate between
    the consumers when SLOTS is odd, so each slot has a barrier per consumer: a consumer then waits
    every phase of its own barriers in turn (with one barrier a slot it would skip the other
    consumer's phases, and a wait could pass on a fill that had not landed yet)."""
    PERIOD: gl.constexpr = 2 * SLOTS if SLOTS % 2 == 1 else SLOTS  # tiles between uses of a barrier
    return ready.index(t % SLOTS + SLOTS * (t % 2)), (t // PERIOD) & 1


@gluon.jit
def _producer_partition(
    nope_desc,
    rope_desc,
    nope_ring,
    rope_ring,
    ready,
    free,
    table,
    start,
    n_tiles,
    RANK: gl.constexpr,
    ROPE: gl.constexpr,
    HALF: gl.constexpr,
    PAGE: gl.constexpr,
    SLOTS: gl.constexpr,
):
    """Tile t into ring slot t % SLOTS (two value halves and the rope box on one barrier), once the
    consumer of tile t - SLOTS freed the slot; the block-table row read before that wait."""
    TILE_BYTES: gl.constexpr = BLOCK_N * (2 * HALF + ROPE)  # fp8: a byte an element
    for t in range(n_tiles):
        slot = t % SLOTS
        row = _tile_row(table, start, t, PAGE)
        # Rounds 0: parity 1 of a fresh barrier passes; later, the consumer's arrival for t - SLOTS.
        mbarrier.wait(free.index(slot), ((t // SLOTS) & 1) ^ 1)
        bar, _ = _ready_barrier(ready, t, SLOTS)
        mbarrier.expect(bar, TILE_BYTES)
        tma_load(nope_desc, [row, 0], bar, nope_ring.index(2 * slot))
        tma_load(nope_desc, [row, HALF], bar, nope_ring.index(2 * slot + 1))
        tma_load(rope_desc, [row, RANK], bar, rope_ring.index(slot))


# The A operands are loaded in an order of the reduction (keys) or output (values) dimensions that
# gives each thread runs of consecutive bytes, then relabelled in registers into wgmma's A layout.
# wgmma's A layout gives a thread two elements a 32-bit register, the rest 8 or 16 dimensions
# apart: read in the tensor's own order that is one 16-bit (keys) or 8-bit (values) load a
# register. The order of a product's reduction dimensions does not change it (the query is staged
# in the same order); the order of the output's only where it is written.
#
# A K chunk [64 keys, 64 dims] as loaded: warp w, lane 4l + c holds keys 16w + l and 16w + l + 8,
# dims 16c .. 16c + 15 (one 16-byte load a key). Dim 16c + 4s + 2h + e is the product's
# 16s + 8h + 2c + e: k-step s, half h of it, lane c, element e of the register.
KEY_CHUNK_LOAD: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
    lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]],
    block_bases=[],
    shape=[64, 64],
)
# A quarter of the values' V^T [128 dims, 64 keys] as loaded: warp w, lane 4l + c holds dims
# 32w + 4l .. + 3 (one 4-byte load a key) of keys 2c + {0, 1} + 8j. Dim 32w + 4l + 2t + h is the
# product's output row 64t + 16w + 8h + l: M-tile t, warp w, half h, lane l.
QUARTER = gl.constexpr(128)
VALUES_T_LOAD: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[1, 0], [2, 0], [0, 1], [0, 8], [0, 16], [0, 32]],
    lane_bases=[[0, 2], [0, 4], [4, 0], [8, 0], [16, 0]],
    warp_bases=[[32, 0], [64, 0]],
    block_bases=[],
    shape=[128, 64],
)


# Two keys' 4 consecutive dims (a word each) -> the 4 dims' (key, next key) f16 pairs: the bytes are
# paired by two byte permutes before the conversion (pairing the converted halves after it takes a
# permute per register).
KEY_PAIRS_TO_F16 = gl.constexpr("""
{
.reg .b32 lo, hi;
.reg .b16 d0, d1, d2, d3;
prmt.b32 lo, $4, $5, 0x5140;
prmt.b32 hi, $4, $5, 0x7362;
mov.b32 {d0, d1}, lo;
mov.b32 {d2, d3}, hi;
cvt.rn.f16x2.e4m3x2 $0, d0;
cvt.rn.f16x2.e4m3x2 $1, d1;
cvt.rn.f16x2.e4m3x2 $2, d2;
cvt.rn.f16x2.e4m3x2 $3, d3;
}
""")


@gluon.jit
def key_dims(k):
    """The cache dimension that the products' reduction index k (query buffer column k) reads."""
    i = k % 64
    return k - i + 16 * ((i // 2) % 4) + 4 * (i // 16) + 2 * ((i // 8) % 2) + i % 2


@gluon.jit
def value_dims(m):
    """The output column of PV's accumulator row m (within a value half: two quarters)."""
    i = m % 128
    return m - i + 32 * ((i // 16) % 4) + 4 * (i % 8) + 2 * (i // 64) + (i // 8) % 2


@gluon.jit
def _key_dims_loaded(ring_box, col0):
    """K [64 keys, CHUNK dims] from an fp8 ring box in f16, its dims in key_dims order (the layout
    a relabel of KEY_CHUNK_LOAD). Keys past the end of the split may hold anything, NaN included:
    the softmax sets their scores to -inf."""
    k = ring_box.slice(col0, CHUNK, dim=1).load(KEY_CHUNK_LOAD).to(gl.float16)
    k = gl.permute(gl.reshape(k, [BLOCK_N, 4, 4, 2, 2]), (0, 2, 3, 1, 4))  # [keys, c, s, h, e] -> s, h, c, e
    return gl.reshape(k, [BLOCK_N, CHUNK])


@gluon.jit
def _key_chunk(ring_box, col0, a_layout: gl.constexpr):
    """K [64 keys, CHUNK dims] as wgmma's A operand."""
    return gl.convert_layout(_key_dims_loaded(ring_box, col0), a_layout)


@gluon.jit
def _key_chunks(ring_box, col0, a_layout: gl.constexpr):
    """K [64 keys, 2 CHUNK dims] as wgmma's A operand: two chunks a wgmma group halves the
    descriptor arithmetic and the waits a tile."""
    both = gl.join(_key_dims_loaded(ring_box, col0), _key_dims_loaded(ring_box, col0 + CHUNK))
    both = gl.reshape(gl.permute(both, (0, 2, 1)), [BLOCK_N, 2 * CHUNK])
    return gl.convert_layout(both, a_layout)


@gluon.jit
def _values_t(ring_box, d0, a_layout: gl.constexpr):
    """V^T [QUARTER dims from d0, 64 keys] of an fp8 ring box as wgmma's A operand in f16, its dims
    in value_dims order."""
    v = ring_box.slice(d0, QUARTER, dim=1).permute((1, 0)).load(VALUES_T_LOAD)
    raw = v.to(gl.uint8, bitcast=True)
    v = gl.inline_asm_elementwise(
        KEY_PAIRS_TO_F16, "=r,=r,=r,=r,r,r", [raw], dtype=gl.float16, is_pure=True, pack=8
    )
    # Each 8 of a thread's elements (dims d .. d + 3 of keys k, k + 1) came back as (dim, key) pairs
    v = gl.permute(gl.reshape(v, [4, 8, 2, 2, BLOCK_N // 2, 2]), (0, 1, 5, 2, 4, 3))
    v = gl.permute(gl.reshape(v, [4, 8, 2, 2, BLOCK_N]), (2, 0, 3, 1, 4))  # [w, l, t, h] -> t, w, h, l
    return gl.convert_layout(gl.reshape(v, [QUARTER, BLOCK_N]), a_layout)


@gluon.jit
def _zero_keys_past(box, valid):
    """Keys >= valid of a ring box zeroed, in place (a split's last tile): their probabilities are 0,
    but the stale cache rows they come from may hold NaN bytes, and 0 x NaN is NaN. Zeroing them
    once here spares every tile the masking of its value operands."""
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [gl.num_warps(), 1], [1, 0])
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    tile = box.load(layout)
    box.store(gl.where((keys < valid)[:, None], tile, gl.zeros_like(tile)))


@gluon.jit
def _join_quarters(first, second, mma: gl.constexpr):
    """Two [QUARTER, rows] accumulators as one [2 QUARTER, rows] (second's rows after first's)."""
    both = gl.permute(gl.join(first, second), (2, 0, 1))  # [2, QUARTER, rows]
    return gl.convert_layout(gl.reshape(both, [2 * QUARTER, first.shape[1]]), mma)


@gluon.jit
def _leave_partial(lo_smem, hi_smem, m_smem, l_smem, acc_lo, acc_hi, m_i, l_i, partial_ready):
    """Consumer 1's online-softmax state (O^T halves, row max, row sum) left in shared memory for
    consumer 0."""
    lo_smem.store(acc_lo.to(lo_smem.dtype))  # f32, or bf16 where f32 does not fit
    hi_smem.store(acc_hi.to(hi_smem.dtype))
    m_smem.store(m_i)
    l_smem.store(l_i)
    cta_barrier()  # every warp's stores before the one arriving thread's release
    mbarrier.arrive(partial_ready, count=1)


@gluon.jit
def _merge_partial(
    lo_smem, hi_smem, m_smem, l_smem, acc_lo, acc_hi, m_i, l_i, partial_ready, mma: gl.constexpr
):
    """Consumer 0's state merged with the one consumer 1 left: (O^T halves, row max, row sum)."""
    row_vec: gl.constexpr = gl.SliceLayout(0, mma)
    mbarrier.wait(partial_ready, 0)
    m_other = m_smem.load(row_vec)
    m_new = gl.maximum(m_i, m_other)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows no key reached stay 0
    alpha = gl.exp2(m_i - m_safe)
    alpha_other = gl.exp2(m_other - m_safe)
    l_i = l_i * alpha + l_smem.load(row_vec) * alpha_other
    acc_lo = acc_lo * alpha[None, :] + lo_smem.load(mma).to(gl.float32) * alpha_other[None, :]
    acc_hi = acc_hi * alpha[None, :] + hi_smem.load(mma).to(gl.float32) * alpha_other[None, :]
    return acc_lo, acc_hi, m_new, l_i


@gluon.jit
def _consumer_partition(
    state,
    HALF: gl.constexpr,
    ROPE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    SLOTS: gl.constexpr,
    CAUSAL: gl.constexpr,
    CONSUMER: gl.constexpr,
):
    """Tiles CONSUMER, CONSUMER + 2, ...: QK, online softmax, PV with the keys and values converted
    in registers, the ring slot freed after PV. Consumer 1 then leaves its partial in the ring slot
    of its last tile; consumer 0 merges it and writes the output."""
    (
        out,
        lse,
        q_lo_buf,
        q_hi_buf,
        q_pe_buf,
        p_buf,
        nope_ring,
        rope_ring,
        ready,
        free,
        partial_ready,
        first_tok,
        q_len,
        seq_len,
        start,
        end,
        n_tiles,
        split,
        score_scale_log2,
        value_scale,
        num_heads,
        stride_ot,
        stride_oh,
        stride_os,
        stride_lt,
        stride_lh,
        stride_ls,
    ) = state
    NUM_WARPS: gl.constexpr = gl.num_warps()
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_M, 16]
    )
    a_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    key_vec: gl.constexpr = gl.SliceLayout(1, mma)
    row_vec: gl.constexpr = gl.SliceLayout(0, mma)
    rows = gl.arange(0, BLOCK_M, layout=row_vec)
    row_ok = rows < q_len * num_heads
    last_visible = seq_len - q_len + rows // num_heads  # causal: keys at positions <= the row's own
    visible_end = gl.minimum(end, seq_len - q_len + 1) if CAUSAL else end  # keys below: seen by all rows
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_vec)
    l_keys = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    # O^T in quarters of QUARTER dims (a quarter's operand is 32 registers: two fit beside them)
    acc_0 = gl.zeros([QUARTER, BLOCK_M], gl.float32, layout=mma)
    acc_1 = gl.zeros([QUARTER, BLOCK_M], gl.float32, layout=mma)
    acc_2 = gl.zeros([QUARTER, BLOCK_M], gl.float32, layout=mma)
    acc_3 = gl.zeros([QUARTER, BLOCK_M], gl.float32, layout=mma)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)

    for i in range((n_tiles + 1 - CONSUMER) // 2):
        t = 2 * i + CONSUMER
        n0 = start + t * BLOCK_N
        valid = end - n0
        slot = t % SLOTS
        lo_box = nope_ring.index(2 * slot)
        hi_box = nope_ring.index(2 * slot + 1)
        # Always 0, not provably so: keeps the query's and P^T's wgmma descriptors next to their use
        # instead of hoisted out of the loop, where they spill (see mla_decode_few_rows).
        here = gl.minimum(valid - 1, 0)
        q_lo = q_lo_buf.index(here)
        q_hi = q_hi_buf.index(here)
        p_smem = p_buf.index(CONSUMER + here)
        landed, parity = _ready_barrier(ready, t, SLOTS)
        mbarrier.wait(landed, parity)
        if valid < BLOCK_N:
            # Ordered before the value loads by the P^T barrier, and before the slot's next TMA
            # fill by the fence and the free barrier. QK may read these keys either way: their
            # scores are masked.
            _zero_keys_past(lo_box, valid)
            _zero_keys_past(hi_box, valid)
            fence_async_shared()

        # QK, one group in flight while the next one is loaded and converted
        s = warpgroup_mma(
            _key_chunk(rope_ring.index(slot), 0, a_operand),
            q_pe_buf.index(here).permute((1, 0)),
            s_zero,
            use_acc=False,
            is_async=True,
        )
        for c in gl.static_range(HALF // (2 * CHUNK)):
            s = warpgroup_mma_wait(1, deps=[s])
            s = warpgroup_mma(
                _key_chunks(lo_box, 2 * c * CHUNK, a_operand),
                q_lo.slice(2 * c * CHUNK, 2 * CHUNK, dim=1).permute((1, 0)),
                s,
                is_async=True,
            )
        for c in gl.static_range(HALF // (2 * CHUNK)):
            s = warpgroup_mma_wait(1, deps=[s])
            s = warpgroup_mma(
                _key_chunks(hi_box, 2 * c * CHUNK, a_operand),
                q_hi.slice(2 * c * CHUNK, 2 * CHUNK, dim=1).permute((1, 0)),
                s,
                is_async=True,
            )
        s = warpgroup_mma_wait(0, deps=[s])

        if n0 + BLOCK_N <= visible_end:  # every key of the tile visible to every row
            s = gl.where(row_ok[None, :], s * score_scale_log2, float("-inf"))
        else:
            s = _masked_scores(s, n0, end, row_ok, last_visible, score_scale_log2, CAUSAL, key_vec)
        m_old = m_i
        prob, alpha, m_i = _softmax_update(s, m_i)
        # alpha is exactly 1 in a row whose max stayed: the 72 multiplies by it are skipped on tiles
        # where no row's max moved (most, once the maxima settle).
        if gl.max((m_i > m_old).to(gl.int32), axis=0) > 0:
            l_keys = l_keys * alpha[None, :]
            acc_0 = acc_0 * alpha[None, :]
            acc_1 = acc_1 * alpha[None, :]
            acc_2 = acc_2 * alpha[None, :]
            acc_3 = acc_3 * alpha[None, :]
        # Row sums kept per key and thread, added across the warps once after the last tile: a
        # tile's sum would be a reduction through shared memory, with its barriers, every tile.
        l_keys = l_keys + prob
        p_smem.store((prob * P_SCALE_F16).to(gl.float16))
        fence_async_shared()
        cta_barrier()
        # A quarter's products in flight while the next quarter is loaded and converted
        acc_0 = warpgroup_mma(_values_t(lo_box, 0, a_operand), p_smem, acc_0, is_async=True)
        acc_1 = warpgroup_mma(_values_t(lo_box, QUARTER, a_operand), p_smem, acc_1, is_async=True)
        acc_0 = warpgroup_mma_wait(1, deps=[acc_0])
        acc_2 = warpgroup_mma(_values_t(hi_box, 0, a_operand), p_smem, acc_2, is_async=True)
        acc_1 = warpgroup_mma_wait(1, deps=[acc_1])
        acc_3 = warpgroup_mma(_values_t(hi_box, QUARTER, a_operand), p_smem, acc_3, is_async=True)
        acc_2, acc_3 = warpgroup_mma_wait(0, deps=[acc_2, acc_3])
        # Every warp's reads of the slot (and of P^T) are done before the one arriving thread frees it.
        cta_barrier()
        mbarrier.arrive(free.index(slot), count=1)

    acc_lo = _join_quarters(acc_0, acc_1, mma)
    acc_hi = _join_quarters(acc_2, acc_3, mma)
    l_i = gl.sum(l_keys, axis=0)
    # Consumer 1's partial goes to the ring slot of its last tile (tile n_tiles - 1 or - 2; a tile
    # SLOTS later would be the only one to reuse that slot, and there is none).
    last_odd = n_tiles - 1 - (n_tiles % 2)
    merge_slot = last_odd % SLOTS
    acc_smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    vec_smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    # A value half's partial [HALF, BLOCK_M] in one fp8 box (BLOCK_N x HALF bytes): f32 where it
    # fits (16 rows), else bf16 (32 rows: f32's range, and consumer 1's share of the sum rounded by
    # up to 2^-9, about what the bf16 output's own rounding adds; f32 split partials keep it)
    if BLOCK_M * 4 <= BLOCK_N:
        PARTIAL: gl.constexpr = gl.float32
        PARTIAL_BYTES: gl.constexpr = 4
    else:
        PARTIAL: gl.constexpr = gl.bfloat16
        PARTIAL_BYTES: gl.constexpr = 2
    PER_BOX: gl.constexpr = BLOCK_N * HALF // (HALF * BLOCK_M * PARTIAL_BYTES)
    VEC_PER_BOX: gl.constexpr = BLOCK_N * ROPE // (BLOCK_M * 4)
    n_boxes: gl.constexpr = nope_ring.shape[0]
    n_rope: gl.constexpr = rope_ring.shape[0]
    accs = smem_reinterpret(nope_ring, PARTIAL, [n_boxes * PER_BOX, HALF, BLOCK_M], acc_smem_layout)
    vecs = smem_reinterpret(rope_ring, gl.float32, [n_rope * VEC_PER_BOX, BLOCK_M], vec_smem_layout)
    lo_smem = accs.index(2 * merge_slot * PER_BOX)
    hi_smem = accs.index((2 * merge_slot + 1) * PER_BOX)
    m_smem = vecs.index(merge_slot * VEC_PER_BOX)
    l_smem = vecs.index(merge_slot * VEC_PER_BOX + 1)
    if CONSUMER == 1:
        if n_tiles > 1:
            _leave_partial(lo_smem, hi_smem, m_smem, l_smem, acc_lo, acc_hi, m_i, l_i, partial_ready)
    else:
        if n_tiles > 1:
            acc_lo, acc_hi, m_i, l_i = _merge_partial(
                lo_smem, hi_smem, m_smem, l_smem, acc_lo, acc_hi, m_i, l_i, partial_ready, mma
            )
        _write_output(
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
            HALF,
            P_SCALE_F16,
            mma,
            value_dims,
        )


@gluon.jit
def mla_decode_fp8_register_operands(
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
    kv_scale,
    num_splits,  # a runtime value: a constexpr compiled a kernel per split count (one per step size)
    RANK: gl.constexpr,
    ROPE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    PAGE: gl.constexpr,
    CAUSAL: gl.constexpr,
    SLOTS: gl.constexpr,
):
    """fp8 cache, <= 32 rows: a producer warp and two consumer warpgroups over a ring of fp8 tiles."""
    HALF: gl.constexpr = RANK // 2
    gl.static_assert(HALF == 256 and ROPE == CHUNK, "the operand loads are laid out for DeepSeek's 512 + 64")
    req = gl.program_id(0)
    split = gl.program_id(1)
    first_tok = gl.load(query_start_loc + req)
    q_len = gl.load(query_start_loc + req + 1) - first_tok
    seq_len = gl.load(seq_lens + req)
    value_scale = gl.load(kv_scale)
    chunk = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = gl.minimum(start + chunk, seq_len)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    table = block_table + req.to(gl.int64) * stride_bt

    q_half_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], gl.float16)
    q_rope_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, ROPE], gl.float16)
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], gl.float16)
    q_lo_buf = gl.allocate_shared_memory(gl.float16, [1, BLOCK_M, HALF], q_half_smem)
    q_hi_buf = gl.allocate_shared_memory(gl.float16, [1, BLOCK_M, HALF], q_half_smem)
    q_pe_buf = gl.allocate_shared_memory(gl.float16, [1, BLOCK_M, ROPE], q_rope_smem)
    p_buf = gl.allocate_shared_memory(gl.float16, [2, BLOCK_N, BLOCK_M], p_smem_layout)  # one a consumer
    nope_ring = gl.allocate_shared_memory(nope_desc.dtype, [2 * SLOTS, BLOCK_N, HALF], nope_desc.layout)
    rope_ring = gl.allocate_shared_memory(rope_desc.dtype, [SLOTS, BLOCK_N, ROPE], rope_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [2 * SLOTS, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    partial_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(ready.index(SLOTS + i), count=1)
        mbarrier.init(free.index(i), count=1)
    mbarrier.init(partial_ready, count=1)
    # The query once, by the default warps before the partitions fork (both consumers read it).
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
        sm_scale_log2 * value_scale,
        RANK,
        ROPE,
        BLOCK_M,
        True,
        key_dims,
    )
    fence_async_shared()
    cta_barrier()

    consumer_state = (
        out,
        lse,
        q_lo_buf,
        q_hi_buf,
        q_pe_buf,
        p_buf,
        nope_ring,
        rope_ring,
        ready,
        free,
        partial_ready,
        first_tok,
        q_len,
        seq_len,
        start,
        end,
        n_tiles,
        split,
        score_scale_log2,
        value_scale,
        num_heads,
        stride_ot,
        stride_oh,
        stride_os,
        stride_lt,
        stride_lh,
        stride_ls,
    )
    gl.warp_specialize(
        [
            (_consumer_partition, (consumer_state, HALF, ROPE, BLOCK_M, SLOTS, CAUSAL, 0)),
            (_consumer_partition, (consumer_state, HALF, ROPE, BLOCK_M, SLOTS, CAUSAL, 1)),
            (
                _producer_partition,
                (
                    nope_desc,
                    rope_desc,
                    nope_ring,
                    rope_ring,
                    ready,
                    free,
                    table,
                    start,
                    n_tiles,
                    RANK,
                    ROPE,
                    HALF,
                    PAGE,
                    SLOTS,
                ),
            ),
        ],
        [CONSUMER_WARPS, PRODUCER_WARPS],
        [CONSUMER_REGS, PRODUCER_REGS],
    )

    for i in gl.static_range(SLOTS):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(ready.index(SLOTS + i))
        mbarrier.invalidate(free.index(i))
    mbarrier.invalidate(partial_ready)


@functools.cache
def ring_tiles(rank: int, rope: int, block_m: int) -> int:
    """Whole fp8 tiles the ring holds next to the f16 query and two P^T of block_m rows."""
    fixed = block_m * (rank + rope) * 2 + 2 * BLOCK_N.value * block_m * 2
    return (SMEM_BYTES - fixed) // (BLOCK_N.value * (rank + rope))


def launch_register_operands(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    stride_os: int,
    stride_ls: int,
    kv_scale: torch.Tensor,
    sm_scale_log2: float,
    rows_per_group: int,
    splits: int,
    causal: bool,
    kv_lora_rank: int,
) -> None:
    """Stage 1 over (request, split) for an fp8 cache and <= 32 rows a request (block_rows)."""
    page, width = kv_cache.shape[1], kv_cache.shape[2]
    block_m = block_rows(rows_per_group)
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
    _launch(
        grid,
        *kernel_args,
        kv_scale,
        RANK=kv_lora_rank,
        ROPE=width - kv_lora_rank,
        BLOCK_M=block_m,
        PAGE=page,
        num_splits=splits,
        CAUSAL=causal,
        SLOTS=ring_tiles(kv_lora_rank, width - kv_lora_rank, block_m),
        num_warps=NUM_WARPS,
    )


_launch = DirectLauncher(mla_decode_fp8_register_operands)  # host time: see jackfield.ops.launch

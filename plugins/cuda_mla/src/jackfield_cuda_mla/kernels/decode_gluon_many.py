"""Stage 1 of dense MLA decode for many rows a request (H a multiple of 64: compute-bound), Gluon, Hopper.

Same contract as `mla_decode_stage1` (dense): one program per (64-row block of a request, KV split)
writes the normalized output and natural-log LSE of its rows (or split partials for stage 2).

Why a second kernel: in the Triton (tl) kernel the chain QK wgmma -> wait -> softmax -> PV wgmma
is serial, and the next tile's load waits for PV (PERF_NOTES.md). Here each step issues PV of tile
t - 1 and QK of tile t back to back as asynchronous wgmma, waits for PV only, refills PV's buffer
with tile t + 1 by TMA while QK(t) runs, then waits for QK and runs tile t's softmax.

Layout: 8 warps; every MMA splits its N dimension over the two warpgroups (warps [4, 2]), so each
warpgroup keeps half of the 64 x 512 fp32 accumulator (128 registers a thread) and computes 32 of
a 64-key tile's scores. Q (64 x 576) stays in shared memory for the whole loop; KV tiles of
BLOCK_N keys arrive by TMA in a ring of STAGES buffers (Q 73.7 KB + 2 x 64-key tiles 147 KB =
221 KB). A tile is both K (QK) and V (PV), so a buffer is free only after PV of its tile. Cache
rows past seq_len may hold NaN, and 0 * NaN = NaN in an MMA, so the one tile that reaches past
seq_len has those rows zeroed in shared memory first.

Requires (`many_rows_shapes_fit` checks it, decode.py the GPU; anything else goes to the tl kernel): heads a
multiple of 64 (a row block is one token's 64 heads, so causality is one bound per program),
16-bit query and cache of the same dtype, PAGE % BLOCK_N == 0, power-of-two 64 <= rope <= rank <= 512,
contiguous query, pages back to back in the cache.
"""

from __future__ import annotations

import torch
import triton
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

from jackfield_cuda_mla.kernels.checks import cache_is_one_matrix
from jackfield_cuda_mla.kernels.gluon_hopper import cta_barrier, smem_layout, tma_load

BLOCK_M = 64  # rows a program: one warpgroup's wgmma M
NUM_WARPS = 8  # two warpgroups, each owning half of every product's N
SMEM_BYTES = 227 * 1024  # shared memory one program may use on sm_90
SMEM_RESERVE = 5 * 1024  # barriers and the compiler's scratch: 4,120 B at the default tile (225,304 B in all)
LN2 = gl.constexpr(0.6931471805599453)
GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.jit
def _issue_tile(
    kv_desc, pe_desc, kv_smem, pe_smem, ready, table, tile, start, pred, BLOCK_N, RANK, STAGES, PAGE
):
    """TMA of tile `tile` (keys start + tile * BLOCK_N ...) into ring slot tile % STAGES, if pred."""
    n0 = start + tile * BLOCK_N
    row = gl.load(table + n0 // PAGE, mask=pred, other=0) * PAGE + n0 % PAGE
    slot = tile % STAGES
    bar = ready.index(slot)
    mbarrier.expect(
        bar, BLOCK_N * (RANK + pe_desc.block_type.shape[1]) * kv_desc.dtype.primitive_bitwidth // 8, pred
    )
    tma_load(kv_desc, [row, 0], bar, kv_smem.index(slot), pred)
    tma_load(pe_desc, [row, RANK], bar, pe_smem.index(slot), pred)


@gluon.jit
def _wait_tile(kv_smem, pe_smem, ready, tile, start, seq_len, BLOCK_N, RANK, ROPE, STAGES):
    """Waits for tile `tile`; zeroes its rows at or past seq_len (they may hold NaN) before any MMA."""
    slot = tile % STAGES
    mbarrier.wait(ready.index(slot), (tile // STAGES) & 1)
    n0 = start + tile * BLOCK_N
    if n0 + BLOCK_N > seq_len:
        # 64 columns at a time: a whole BLOCK_N x 512 tile in registers would spill the accumulator
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        key = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        for c in gl.static_range(RANK // ROPE):
            chunk = kv_smem.index(slot).slice(c * ROPE, ROPE, dim=1)
            values = chunk.load(layout)
            chunk.store(gl.where(key[:, None] < seq_len, values, gl.zeros_like(values)))
        values = pe_smem.index(slot).load(layout)
        pe_smem.index(slot).store(gl.where(key[:, None] < seq_len, values, gl.zeros_like(values)))
        fence_async_shared()  # the generic-proxy stores must be visible to wgmma's async reads
        cta_barrier()


@gluon.jit
def _softmax_step(
    s, tile, start, end, m_i, l_i, sm_scale_log2, BLOCK_N: gl.constexpr, S_LAYOUT: gl.constexpr
):
    """Base-2 online softmax over one score tile: (probabilities, rescale factor, new max, new sum)."""
    key = start + tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    s = gl.where(key[None, :] < end, s * sm_scale_log2, float("-inf"))
    # The first key of every processed tile is visible to all 64 rows (one causal bound a program),
    # so m_new is finite and exp2(-inf - m_new) = 0 needs no guard.
    m_new = gl.maximum(m_i, gl.max(s, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def mla_decode_many_rows(
    q_nope_desc,
    q_pe_desc,
    kv_desc,
    pe_desc,
    block_table,
    seq_lens,
    query_start_loc,
    out,
    lse,
    sm_scale_log2,
    num_heads,
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
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    PAGE: gl.constexpr,
    CAUSAL: gl.constexpr,
):
    BLOCK_M: gl.constexpr = q_nope_desc.block_type.shape[0]
    dtype: gl.constexpr = kv_desc.dtype
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 2], [16, BLOCK_N // 2, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 2], [16, RANK // 2, 16])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(0, O_LAYOUT, 2)

    # Row blocks of one request are neighbouring program ids: they run together and share each KV
    # tile through L2. A row block is one query token's 64 consecutive heads.
    row_block = gl.program_id(0)
    req = gl.program_id(1)
    split = gl.program_id(2)
    head_blocks = num_heads // BLOCK_M
    tok_in_req = row_block // head_blocks
    head0 = (row_block % head_blocks) * BLOCK_M
    first_tok = gl.load(query_start_loc + req)
    q_len = gl.load(query_start_loc + req + 1) - first_tok
    seq_len = gl.load(seq_lens + req)
    block_valid = tok_in_req < q_len
    tok = first_tok + tok_in_req

    chunk = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = gl.minimum(start + chunk, seq_len)
    if CAUSAL:
        end = gl.minimum(end, seq_len - q_len + tok_in_req + 1)  # keys up to the token's own position
    end = gl.where(block_valid, end, start)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)

    q_nope_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, RANK], q_nope_desc.layout)
    q_pe_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, ROPE], q_pe_desc.layout)
    kv_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, RANK], kv_desc.layout)
    pe_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, ROPE], pe_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    mbarrier.init(q_ready, count=1)
    fence_async_shared()

    q_row = tok * num_heads + head0
    mbarrier.expect(q_ready, BLOCK_M * (RANK + ROPE) * dtype.primitive_bitwidth // 8, block_valid)
    tma_load(q_nope_desc, [q_row, 0], q_ready, q_nope_smem, block_valid)
    tma_load(q_pe_desc, [q_row, RANK], q_ready, q_pe_smem, block_valid)
    table = block_table + req.to(gl.int64) * stride_bt
    for i in gl.static_range(STAGES):
        _issue_tile(
            kv_desc,
            pe_desc,
            kv_smem,
            pe_smem,
            ready,
            table,
            i,
            start,
            i < n_tiles,
            BLOCK_N,
            RANK,
            STAGES,
            PAGE,
        )
    mbarrier.wait(q_ready, 0, pred=block_valid)

    o = gl.zeros([BLOCK_M, RANK], gl.float32, O_LAYOUT)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, S_LAYOUT))
    p_op = gl.zeros([BLOCK_M, BLOCK_N], dtype, P_LAYOUT)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)

    if n_tiles > 0:  # tile 0: scores and probabilities; its PV is issued by the loop
        _wait_tile(kv_smem, pe_smem, ready, 0, start, seq_len, BLOCK_N, RANK, ROPE, STAGES)
        s = warpgroup_mma(q_nope_smem, kv_smem.index(0).permute((1, 0)), s_zero, use_acc=False)
        s = warpgroup_mma(q_pe_smem, pe_smem.index(0).permute((1, 0)), s)
        p, alpha, m_i, l_i = _softmax_step(s, 0, start, end, m_i, l_i, sm_scale_log2, BLOCK_N, S_LAYOUT)
        p_op = gl.convert_layout(p.to(dtype), P_LAYOUT)

    for t in range(1, n_tiles):
        prev = (t - 1) % STAGES
        slot = t % STAGES
        # PV(t - 1) goes first so its buffer is free, and refilled, while QK(t) runs (H200: 348 us
        # against 458 us with QK first and tile t's softmax overlapping PV(t - 1), PERF_NOTES.md).
        o_tok = warpgroup_mma(p_op, kv_smem.index(prev), o, is_async=True)
        _wait_tile(kv_smem, pe_smem, ready, t, start, seq_len, BLOCK_N, RANK, ROPE, STAGES)
        s_tok = warpgroup_mma(
            q_nope_smem, kv_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True
        )
        s_tok = warpgroup_mma(q_pe_smem, pe_smem.index(slot).permute((1, 0)), s_tok, is_async=True)
        o, p_op = warpgroup_mma_wait(2, deps=[o_tok, p_op])  # PV(t - 1) done; QK(t)'s two groups run on
        cta_barrier()  # both warpgroups are past PV(t - 1): its buffer takes tile t - 1 + STAGES
        _issue_tile(
            kv_desc,
            pe_desc,
            kv_smem,
            pe_smem,
            ready,
            table,
            t - 1 + STAGES,
            start,
            t - 1 + STAGES < n_tiles,
            BLOCK_N,
            RANK,
            STAGES,
            PAGE,
        )
        s = warpgroup_mma_wait(0, deps=[s_tok])
        p, alpha, m_i, l_i = _softmax_step(s, t, start, end, m_i, l_i, sm_scale_log2, BLOCK_N, S_LAYOUT)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
        p_op = gl.convert_layout(p.to(dtype), P_LAYOUT)

    if n_tiles > 0:
        o = warpgroup_mma(p_op, kv_smem.index((n_tiles - 1) % STAGES), o)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    mbarrier.invalidate(q_ready)

    seen = l_i > 0.0
    denom = gl.where(seen, l_i, 1.0)
    row_lse = gl.where(seen, (m_i + gl.log2(denom)) * LN2, float("-inf"))
    inv = gl.convert_layout(gl.where(seen, 1.0 / denom, 0.0), gl.SliceLayout(1, O_LAYOUT))
    result = o * inv[:, None]

    rows_valid = gl.where(block_valid, BLOCK_M, 0)
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O_LAYOUT))
    cols = gl.arange(0, RANK, layout=gl.SliceLayout(0, O_LAYOUT))
    o_base = out + tok.to(gl.int64) * stride_ot + split * stride_os
    o_ptr = o_base + (head0 + rows)[:, None].to(gl.int64) * stride_oh + cols[None, :]
    gl.store(
        o_ptr, result.to(out.dtype.element_ty), mask=(rows[:, None] < rows_valid) & (cols[None, :] < RANK)
    )
    l_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_LAYOUT))
    l_ptr = lse + tok.to(gl.int64) * stride_lt + split * stride_ls + (head0 + l_rows) * stride_lh
    gl.store(l_ptr, row_lse, mask=l_rows < rows_valid)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def many_rows_shapes_fit(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_lora_rank: int,
    block_n: int,
    stages: int,
) -> bool:
    """The dtypes, widths, tiles and layouts this kernel serves, its shared memory within sm_90's."""
    tokens, heads, width = query.shape
    rope = width - kv_lora_rank
    page = kv_cache.shape[1]
    return (
        query.dtype in GL_DTYPES
        and kv_cache.dtype == query.dtype
        and heads % BLOCK_M == 0
        and _power_of_two(kv_lora_rank)
        and _power_of_two(rope)
        and 64 <= rope <= kv_lora_rank <= 512  # O's N per warpgroup <= 256; pe zeroed in 64-wide chunks
        and block_n in (32, 64)  # the tiles the device tests cover
        and stages >= 2
        and page % block_n == 0
        and query.is_contiguous()  # Q as a [tokens x heads, width] matrix for TMA
        and query.data_ptr() % 16 == 0
        and cache_is_one_matrix(kv_cache)
        # Q plus the ring in one program's shared memory (more stages or wider rope would not launch)
        and (BLOCK_M + stages * block_n) * width * query.element_size() + SMEM_RESERVE <= SMEM_BYTES
    )


def launch_many_rows(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    stride_os: int,
    stride_ls: int,
    *,
    sm_scale_log2: float,
    kv_lora_rank: int,
    max_query_len: int,
    splits: int,
    causal: bool,
    block_n: int,
    stages: int,
) -> None:
    """Stage 1 over every (64-row block, request, split); `many_rows_shapes_fit` must hold, on Hopper."""
    tokens, heads, width = query.shape
    rope = width - kv_lora_rank
    page = kv_cache.shape[1]
    element = GL_DTYPES[query.dtype]

    def descriptor(base: torch.Tensor, rows: int, row_stride: int, box: list[int]) -> TensorDescriptor:
        return TensorDescriptor(base, [rows, width], [row_stride, 1], box, smem_layout(tuple(box), element))

    cache_rows, cache_stride = kv_cache.shape[0] * page, kv_cache.stride(1)
    _launch_many_rows(
        (triton.cdiv(max_query_len * heads, BLOCK_M), seq_lens.numel(), splits),
        descriptor(query, tokens * heads, width, [BLOCK_M, kv_lora_rank]),
        descriptor(query, tokens * heads, width, [BLOCK_M, rope]),
        descriptor(kv_cache, cache_rows, cache_stride, [block_n, kv_lora_rank]),
        descriptor(kv_cache, cache_rows, cache_stride, [block_n, rope]),
        block_table,
        seq_lens,
        query_start_loc,
        part_out,
        part_lse,
        sm_scale_log2,
        heads,
        block_table.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        stride_os,
        part_lse.stride(0),
        part_lse.stride(1),
        stride_ls,
        RANK=kv_lora_rank,
        ROPE=rope,
        BLOCK_N=block_n,
        STAGES=stages,
        PAGE=page,
        num_splits=splits,
        CAUSAL=causal,
        num_warps=NUM_WARPS,
    )


_launch_many_rows = DirectLauncher(mla_decode_many_rows)  # host time: see jackfield.ops.launch

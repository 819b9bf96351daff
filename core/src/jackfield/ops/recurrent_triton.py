"""Triton kernels of the gated delta rule and the Mamba2 scan over a step's flat batch: the same
contract as ops/recurrent.py's PyTorch ops (slots, zero start where `has_state` is false, the
state after each row of kept requests), which are their reference.

One program per (request, value head, block of value columns) keeps its slice of the state in
registers and steps through the request's rows: a decode is one iteration, a prefill chunk as
many as its rows, so one launch serves a mixed step (and chunks that continue a prompt start
from the state the last chunk left). Everything is float32 inside; the state is read once and
written once per step (and once per row for kept requests: rows 0 .. kept_rows - 1 of the
per-row buffer, those past a request's own rows holding the state its last row left, as the
PyTorch ops' padding columns do).

The gated delta rule's chunked form (steps with a request of more than CHUNK = 64 rows and no
kept states; Yang et al. 2024, "Gated Delta Networks", the chunkwise WY/UT algorithm) is two
kernels over the flat batch, chunks of C = 64 rows counted from each request's first row (the
last one partial; nothing padded across requests):
- `_gdn_chunk_local_kernel`, one program per (request, chunk, value head), everything that does
  not need the state entering the chunk: the Gram matrix, the triangular solve T = (I + A)^-1,
  W = T (beta exp(G) K), U0 = T (beta V), Q' = exp(G) Q - P W and the chunk's own outputs P U0.
- `_gdn_chunk_state_kernel`, one program per (request, value head, 32 value columns), walks the
  request's chunks with its [Dk, 32] state slice in registers: U = U0 - W S, out += Q' S,
  S = exp(G_last) S + (exp(G_last - G) K)^T U.
Dots are float32 by tf32x3 (three tf32 tensor-core passes): the tests hold the op to float64
recurrences at 1e-4, which neither bf16 operands (fla's choice, ~4e-3 relative) nor plain tf32
(~5e-4) meet.

The count at Qwen3-Next's shape (Hk 16, Hv 32, Dk = Dv = 128), per chunk and value head, in
FLOPs (2 per multiply-add): the Gram matrices K K^T and Q K^T, 2 x 2 C^2 Dk = 2.1 M; the solve,
substitution within 16-row blocks (0.03 M) and the nilpotent product over them (4 dense C^3
products, 2.1 M); W, U0, P W, P U0, 4 x 2 C^2 D = 4.2 M; the state kernel's W S, Q' S and
K^T U, 3 x 2 C Dk Dv = 6.3 M. 14.7 M in all (12.6 M without the product: the algorithm's own),
so 30 GFLOP for 4,096 tokens (1 x 4096) and 60 GFLOP for 8,192 (4 x 2048). Floors at 4,096
tokens: bf16 tensor cores (~700 TFLOP/s) 43 us, tf32 (~350) 86 us, tf32x3 (three passes) 260
us, float32 FMA (~60) 500 us. Bytes the op must move (bf16 q, k, v; float32 g, beta, out; each
state read and written once): 140 MB at 1 x 4096, 287 MB at 4 x 2048, 33 / 68 us at 4.2 TB/s.
These kernels also pass float32 W, Q', U0 and the partial outputs between them: ~0.6 GB
written and read per 4,096 tokens, ~150 us at copy speed, on top of the op's own bytes. So the
floor of this design is ~260 us of tf32x3 per 4,096 tokens, partly overlapped with ~180 us of
memory traffic; flash-linear-attention measured 862 / 777 us (H200, s34) with bf16 dots.

What the PyTorch chunked form (ops.recurrent._delta_rule_chunked, with chunk_scan_triton for
the scan: 4,094 / 8,217 us on the H200) spends beyond that: float32 PyTorch ops without tensor
cores (matmuls, the batched solve_triangular over every chunk), every input gathered into
[B, max_query_len] padded copies (a long request beside short ones pads them all), the q and k
heads repeated to the value heads in float32, [C, C] decay matrices materialized per chunk and
head, the scan's inputs copied to contiguous float32, and a few dozen launches. The split of
the time between those was not measured.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from jackfield.contracts.recurrent import RecurrentMetadata
from jackfield.ops.launch import DirectLauncher

SOLVE_BLOCK = 16  # rows of the diagonal blocks the chunked GDN inverts by substitution
COLUMN_BLOCK = 32  # key / value columns a step of the chunked GDN's local kernel
VALUE_BLOCK = 32  # value columns (GDN) / head dims (Mamba2) per program: the state slice in registers


@triton.jit
def _gated_delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, states_ptr, rows_ptr,
                             qsl_ptr, slots_ptr, has_state_ptr, keep_ptr, scale, kept_rows,
                             HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                             BK: tl.constexpr, BV: tl.constexpr):
    b, h, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = h // (HV // HK)
    start, end = tl.load(qsl_ptr + b), tl.load(qsl_ptr + b + 1)
    slot, keep = tl.load(slots_ptr + b).to(tl.int64), tl.load(keep_ptr + b)
    dk = tl.arange(0, BK)
    dv = block * BV + tl.arange(0, BV)
    mk, mv = dk < DK, dv < DV
    mask = mk[:, None] & mv[None, :]
    cell = dk[:, None] * DV + dv[None, :]
    state_at = states_ptr + (slot * HV + h) * DK * DV + cell
    state = tl.load(state_at, mask=mask, other=0.0)
    state = tl.where(tl.load(has_state_ptr + b) != 0, state, 0.0)  # a garbage slot never leaks in
    for t in range(start, end):
        q = tl.load(q_ptr + (t * HK + hk) * DK + dk, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + (t * HK + hk) * DK + dk, mask=mk, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
        v = tl.load(v_ptr + (t * HV + h) * DV + dv, mask=mv, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + t * HV + h).to(tl.float32))
        beta = tl.load(beta_ptr + t * HV + h).to(tl.float32)
        state = state * decay
        delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
        state = state + k[:, None] * delta[None, :]
        tl.store(out_ptr + (t * HV + h) * DV + dv, tl.sum(state * q[:, None], axis=0), mask=mv)
        if keep >= 0:
            row = (keep.to(tl.int64) * kept_rows + (t - start)) * HV + h
            tl.store(rows_ptr + row * DK * DV + cell, state, mask=mask)
    if keep >= 0:  # a kept request shorter than the longest: its last state fills its later rows
        for j in range(end - start, kept_rows):
            row = (keep.to(tl.int64) * kept_rows + j) * HV + h
            tl.store(rows_ptr + row * DK * DV + cell, state, mask=mask)
    tl.store(state_at, state, mask=mask)


@triton.jit
def _mamba2_scan_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, out_ptr, states_ptr, rows_ptr,
                        qsl_ptr, slots_ptr, has_state_ptr, keep_ptr, dt_min, dt_max, kept_rows,
                        H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                        BP: tl.constexpr, BN: tl.constexpr):
    r, h, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    group = h // (H // G)
    start, end = tl.load(qsl_ptr + r), tl.load(qsl_ptr + r + 1)
    slot, keep = tl.load(slots_ptr + r).to(tl.int64), tl.load(keep_ptr + r)
    p = block * BP + tl.arange(0, BP)
    n = tl.arange(0, BN)
    mp, mn = p < P, n < N
    mask = mp[:, None] & mn[None, :]
    cell = p[:, None] * N + n[None, :]
    state_at = states_ptr + (slot * H + h) * P * N + cell
    state = tl.load(state_at, mask=mask, other=0.0)
    state = tl.where(tl.load(has_state_ptr + r) != 0, state, 0.0)
    a = tl.load(a_ptr + h).to(tl.float32)
    d = tl.load(d_ptr + h).to(tl.float32)
    bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    for t in range(start, end):
        dt = tl.load(dt_ptr + t * H + h).to(tl.float32) + bias
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))  # softplus (PyTorch's threshold)
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        x = tl.load(x_ptr + (t * H + h) * P + p, mask=mp, other=0.0).to(tl.float32)
        bt = tl.load(b_ptr + (t * G + group) * N + n, mask=mn, other=0.0).to(tl.float32)
        ct = tl.load(c_ptr + (t * G + group) * N + n, mask=mn, other=0.0).to(tl.float32)
        state = state * tl.exp(dt * a) + (dt * x)[:, None] * bt[None, :]
        tl.store(out_ptr + (t * H + h) * P + p, tl.sum(state * ct[None, :], axis=1) + d * x, mask=mp)
        if keep >= 0:
            row = (keep.to(tl.int64) * kept_rows + (t - start)) * H + h
            tl.store(rows_ptr + row * P * N + cell, state, mask=mask)
    if keep >= 0:  # as in the gated delta rule: the last state fills a shorter kept request's rows
        for j in range(end - start, kept_rows):
            row = (keep.to(tl.int64) * kept_rows + j) * H + h
            tl.store(rows_ptr + row * P * N + cell, state, mask=mask)
    tl.store(state_at, state, mask=mask)


@triton.jit
def _chunk_scan_kernel(q_ptr, attend_ptr, values_ptr, corr_ptr, keys_ptr, decay_ptr, out_ptr, state_ptr,
                       num_chunks, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, HAS_CORRECTIONS: tl.constexpr):
    """ops.recurrent._chunk_scan for one (request, head) and BV state columns: the state slice
    [K, BV] stays in registers from chunk to chunk; the products are tensor-core dots."""
    bh, block = tl.program_id(0), tl.program_id(1)
    rows, kk = tl.arange(0, C), tl.arange(0, BK)
    vv = block * BV + tl.arange(0, BV)
    mk, mv = kk < K, vv < V
    state_at = state_ptr + bh.to(tl.int64) * K * V + kk[:, None] * V + vv[None, :]
    state = tl.load(state_at, mask=mk[:, None] & mv[None, :], other=0.0)
    for n in range(num_chunks):
        chunk = bh.to(tl.int64) * num_chunks + n
        at_k = chunk * C * K + rows[:, None] * K + kk[None, :]
        at_v = chunk * C * V + rows[:, None] * V + vv[None, :]
        queries = tl.load(q_ptr + at_k, mask=mk[None, :], other=0.0)
        keys = tl.load(keys_ptr + at_k, mask=mk[None, :], other=0.0)
        attend = tl.load(attend_ptr + chunk * C * C + rows[:, None] * C + rows[None, :])
        u = tl.load(values_ptr + at_v, mask=mv[None, :], other=0.0)
        if HAS_CORRECTIONS:
            corrections = tl.load(corr_ptr + at_k, mask=mk[None, :], other=0.0)
            u = u - tl.dot(corrections, state, input_precision="tf32x3")
        out = tl.dot(queries, state, input_precision="tf32x3") + tl.dot(attend, u, input_precision="tf32x3")
        tl.store(out_ptr + at_v, out, mask=mv[None, :])
        decay = tl.load(decay_ptr + chunk)
        state = decay * state + tl.dot(tl.trans(keys), u, input_precision="tf32x3")
    tl.store(state_at, state, mask=mk[:, None] & mv[None, :])


def chunk_scan_shared_bytes(block_k: int, block_v: int, rows: int, corrections: bool, stages: int) -> int:
    """An upper bound of the chunk scan's shared memory per program at `stages` pipeline stages:
    a chunk's loads (float32 [C, BK] queries, keys and corrections, [C, C] attend, [C, BV]
    values) kept in flight for each stage past the first, and the dots' staged operands (the
    [BK, BV] state slice and a [C, BV] product, two buffers each). Checked against Triton's own
    count for sm_90 in core/tests/ops/test_recurrent_ops.py."""
    chunk = 4 * rows * (block_k * (3 if corrections else 2) + rows + block_v)
    return (stages - 1) * chunk + 8 * block_k * block_v + 8 * rows * block_v


@functools.cache
def _shared_memory_limit(device: int) -> int:
    """Shared memory a program may use on CUDA device `device` (227 KiB on H100 and H200)."""
    return int(triton.runtime.driver.active.utils.get_device_properties(device)["max_shared_mem"])


def chunk_scan_stages(block_k: int, block_v: int, rows: int, corrections: bool, limit: int) -> int:
    """The chunk scan's pipeline stages: the most, up to Triton's default of 3 (a chunk's loads
    issued two chunks ahead of its dots), whose shared memory fits `limit`. At Qwen3-Next's
    Dk = Dv = 128 with corrections, 2 (3 would need 272 KiB)."""
    fitting = (s for s in (3, 2) if chunk_scan_shared_bytes(block_k, block_v, rows, corrections, s) <= limit)
    return next(fitting, 1)


launch_gated_delta_rule = DirectLauncher(_gated_delta_rule_kernel)
launch_mamba2_scan = DirectLauncher(_mamba2_scan_kernel)
launch_chunk_scan = DirectLauncher(_chunk_scan_kernel)


def _keep_index(meta: RecurrentMetadata) -> torch.Tensor:
    """int32 [B]: each request's index among the kept ones, -1 for the others."""
    index = torch.full((meta.num_reqs,), -1, dtype=torch.int32, device=meta.state_slots.device)
    kept = meta.keep_requests.numel()
    if kept:
        index[meta.keep_requests] = torch.arange(kept, dtype=torch.int32, device=index.device)
    return index


def _row_states(meta: RecurrentMetadata, states: torch.Tensor,
                kept: list[torch.Tensor] | None) -> torch.Tensor:
    """The buffer the kernels write kept requests' per-row states into ([V, kept_rows, *state]),
    or the pool itself as a never-written stand-in when nothing is kept."""
    if kept is None or meta.kept_rows == 0:
        return states
    rows = torch.empty(meta.keep_requests.numel(), meta.kept_rows, *states.shape[1:],
                       dtype=states.dtype, device=states.device)
    kept.append(rows)
    return rows


def gated_delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, states: torch.Tensor, meta: RecurrentMetadata,
                            kept: list[torch.Tensor] | None = None) -> torch.Tensor:
    """ops.recurrent.gated_delta_rule in one launch (its checks ran in the caller)."""
    tokens, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    out = torch.empty(tokens, hv, dv, dtype=torch.float32, device=q.device)
    rows = _row_states(meta, states, kept)
    block = min(VALUE_BLOCK, triton.next_power_of_2(dv))
    grid = (meta.num_reqs, hv, triton.cdiv(dv, block))
    launch_gated_delta_rule(grid, q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(),
                            beta.float().contiguous(), out, states, rows, meta.query_start_loc,
                            meta.state_slots, meta.has_state, _keep_index(meta), dk**-0.5, meta.kept_rows,
                            HK=hk, HV=hv, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=block)
    return out


def mamba2_scan_triton(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       c: torch.Tensor, d: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float],
                       states: torch.Tensor, meta: RecurrentMetadata,
                       kept: list[torch.Tensor] | None = None) -> torch.Tensor:
    """ops.recurrent.mamba2_scan in one launch (its checks ran in the caller)."""
    tokens, heads, p = x.shape
    groups, n = b.shape[1], b.shape[2]
    out = torch.empty(tokens, heads, p, dtype=torch.float32, device=x.device)
    rows = _row_states(meta, states, kept)
    block = min(VALUE_BLOCK, triton.next_power_of_2(p))
    grid = (meta.num_reqs, heads, triton.cdiv(p, block))
    launch_mamba2_scan(grid, x.contiguous(), dt.contiguous(), a.float().contiguous(), b.contiguous(),
                       c.contiguous(), d.contiguous(), dt_bias.contiguous(), out, states, rows,
                       meta.query_start_loc, meta.state_slots, meta.has_state, _keep_index(meta),
                       float(dt_limit[0]), float(dt_limit[1]), meta.kept_rows, H=heads, G=groups, P=p,
                       N=n, BP=block, BN=triton.next_power_of_2(n))
    return out


def chunk_scan_triton(queries: torch.Tensor, attend: torch.Tensor, values: torch.Tensor,
                      corrections: torch.Tensor | None, keys_to_end: torch.Tensor, last_decay: torch.Tensor,
                      state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.recurrent._chunk_scan in one launch: returns (out [B, H, n, C, V], the final state)."""
    batch, heads, chunks, rows, k = queries.shape
    v = values.shape[-1]
    state = state.float().contiguous().clone()
    out = torch.empty(batch, heads, chunks, rows, v, dtype=torch.float32, device=values.device)
    inputs = [t.float().contiguous() for t in (queries, attend, values, keys_to_end, last_decay)]
    corr = inputs[0] if corrections is None else corrections.float().contiguous()  # unread without
    block_v = max(16, min(VALUE_BLOCK, triton.next_power_of_2(v)))  # tl.dot takes 16 or more
    block_k = max(16, triton.next_power_of_2(k))
    options: dict[str, int] = {}
    if state.is_cuda:  # the interpreter has no shared memory to fit
        limit = _shared_memory_limit(state.get_device())
        options["num_stages"] = chunk_scan_stages(block_k, block_v, rows, corrections is not None, limit)
    launch_chunk_scan((batch * heads, triton.cdiv(v, block_v)), inputs[0], inputs[1], inputs[2], corr,
                      inputs[3], inputs[4], out, state, chunks, K=k, V=v, C=rows, BK=block_k, BV=block_v,
                      HAS_CORRECTIONS=corrections is not None, **options)
    return out, state


@triton.jit
def _gdn_chunk_local_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, qsl_ptr, w_ptr, u_ptr, qs_ptr, cum_ptr,
                            out_ptr, scale, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                            DV: tl.constexpr, CB: tl.constexpr, C: tl.constexpr,
                            SOLVE_BLOCK: tl.constexpr, SOLVE_FACTORS: tl.constexpr):
    """Everything of one (request, chunk, value head) that does not need the state entering the
    chunk (the WY/UT form; see the module docstring): with G the cumulative log decay within the
    chunk and T = (I + A)^-1, A[i, j] = beta_i exp(G_i - G_j) k_i.k_j (j < i), it writes

        W = T (beta exp(G) K),  U0 = T (beta V),  Q' = exp(G) Q - P W,  out = P U0

    (P[i, j] = exp(G_i - G_j) q_i.k_j for j <= i) and G, so that from a state S the chunk's
    corrections are U = U0 - W S, its outputs out + Q' S and the next state
    exp(G_last) S + (exp(G_last - G) K)^T U (_gdn_chunk_state_kernel)."""
    b, n, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(qsl_ptr + b) + n * C
    end = tl.load(qsl_ptr + b + 1)
    if start >= end:  # the grid covers the longest request's chunks
        return
    hk = h // (HV // HK)
    i = tl.arange(0, C)
    rows = start + i
    live = rows < end  # a request's last chunk may be partial: zero rows past it change nothing
    # K K^T and Q K^T (and the rows' squared norms) summed over blocks of CB columns: one
    # tf32x3 dot of whole [C, Dk] float32 operands stages 128 KiB of shared memory on sm_90
    # (one program an SM) and spilled 2.6 KiB of registers
    gram = tl.zeros((C, C), dtype=tl.float32)
    scores = tl.zeros((C, C), dtype=tl.float32)
    k_norm = tl.zeros((C,), dtype=tl.float32)
    q_norm = tl.zeros((C,), dtype=tl.float32)
    for first in range(0, DK, CB):
        cols = first + tl.arange(0, CB)
        at = (rows[:, None] * HK + hk) * DK + cols[None, :]
        mask = live[:, None] & (cols < DK)[None, :]
        k = tl.load(k_ptr + at, mask=mask, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + at, mask=mask, other=0.0).to(tl.float32)
        gram += tl.dot(k, tl.trans(k), input_precision="tf32x3")
        scores += tl.dot(q, tl.trans(k), input_precision="tf32x3")
        k_norm += tl.sum(k * k, axis=1)
        q_norm += tl.sum(q * q, axis=1)
    k_norm = tl.rsqrt(k_norm + 1e-6)
    q_norm = tl.rsqrt(q_norm + 1e-6) * scale
    g = tl.load(g_ptr + rows * HV + h, mask=live, other=0.0)
    beta = tl.load(beta_ptr + rows * HV + h, mask=live, other=0.0)
    cum = tl.cumsum(g, axis=0)
    causal = i[:, None] >= i[None, :]
    pairwise = tl.where(causal, tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
    # T = (I + A)^-1, A strictly lower. First the inverses of A's diagonal blocks D (16 rows
    # each, the blocks side by side as [C / 16, 16, 16]) by forward substitution on the CUDA
    # cores: row r of (I + D)^-1 - I is -D[r] - sum_{j < r} D[r, j] ((I + D)^-1 - I)[j], the
    # rows above it already done (the tile holds -D below them). Then with E = A - D (below the
    # diagonal blocks), N = (I + D)^-1 E is nilpotent (N^(C / 16) = 0): T = (I + N)^-1 (I + D)^-1
    # with (I + N)^-1 = (I - N)(I + N^2)(I + N^4)... (tensor-core dots).
    lower = tl.where(i[:, None] > i[None, :],
                     gram * (k_norm * beta)[:, None] * k_norm[None, :] * pairwise, 0.0)
    BLOCKS: tl.constexpr = C // SOLVE_BLOCK
    nb, rb = tl.arange(0, BLOCKS), tl.arange(0, SOLVE_BLOCK)
    own_block = nb[:, None, None, None] == nb[None, None, :, None]  # [blocks, 16, blocks, 16]
    blocks = -tl.sum(tl.where(own_block, tl.reshape(lower, (BLOCKS, SOLVE_BLOCK, BLOCKS, SOLVE_BLOCK)), 0.0),
                     axis=2)  # -D as [blocks, 16, 16]
    for r in range(1, SOLVE_BLOCK):
        at_r = (rb == r)[None, :, None]
        row = tl.sum(tl.where(at_r, blocks, 0.0), axis=1)  # [blocks, 16]
        row = row + tl.sum(row[:, :, None] * blocks, axis=1)
        blocks = tl.where(at_r, row[:, None, :], blocks)
    diagonal = tl.reshape(tl.where(own_block, blocks[:, :, None, :], 0.0), (C, C))
    eye = tl.where(i[:, None] == i[None, :], 1.0, 0.0)
    same_block = (i[:, None] // SOLVE_BLOCK) == (i[None, :] // SOLVE_BLOCK)
    inverse = diagonal + eye
    nilpotent = tl.dot(inverse, tl.where(same_block, 0.0, lower), input_precision="tf32x3")
    series = eye - nilpotent
    for _ in tl.static_range(1, SOLVE_FACTORS):
        nilpotent = tl.dot(nilpotent, nilpotent, input_precision="tf32x3")
        series = series + tl.dot(series, nilpotent, input_precision="tf32x3")
    inverse = tl.dot(series, inverse, input_precision="tf32x3")
    tl.store(cum_ptr + rows * HV + h, cum, mask=live)
    attend = scores * q_norm[:, None] * k_norm[None, :] * pairwise
    # W, Q', U0 and out by blocks of CB columns too (their inputs loaded again, from the caches)
    for first in range(0, DK, CB):
        cols = first + tl.arange(0, CB)
        at = (rows[:, None] * HK + hk) * DK + cols[None, :]
        mask = live[:, None] & (cols < DK)[None, :]
        keys = tl.load(k_ptr + at, mask=mask, other=0.0).to(tl.float32)
        w = tl.dot(inverse, keys * (k_norm * beta * tl.exp(cum))[:, None], input_precision="tf32x3")
        queries = tl.load(q_ptr + at, mask=mask, other=0.0).to(tl.float32) * (q_norm * tl.exp(cum))[:, None]
        at = (rows[:, None] * HV + h) * DK + cols[None, :]
        tl.store(w_ptr + at, w, mask=mask)
        tl.store(qs_ptr + at, queries - tl.dot(attend, w, input_precision="tf32x3"), mask=mask)
    for first in range(0, DV, CB):
        cols = first + tl.arange(0, CB)
        at = (rows[:, None] * HV + h) * DV + cols[None, :]
        mask = live[:, None] & (cols < DV)[None, :]
        values = tl.load(v_ptr + at, mask=mask, other=0.0).to(tl.float32) * beta[:, None]
        u = tl.dot(inverse, values, input_precision="tf32x3")
        tl.store(u_ptr + at, u, mask=mask)
        tl.store(out_ptr + at, tl.dot(attend, u, input_precision="tf32x3"), mask=mask)


@triton.jit
def _gdn_chunk_state_kernel(k_ptr, w_ptr, u_ptr, qs_ptr, cum_ptr, out_ptr, states_ptr, qsl_ptr, slots_ptr,
                            has_state_ptr, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                            DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr):
    """The sequential part for one (request, value head, block of BV value columns): the state
    slice [DK, BV] stays in registers from chunk to chunk (U = U0 - W S; out += Q' S;
    S = exp(G_last) S + (exp(G_last - G) K)^T U), read from the request's slot (or zero) and
    written back after its last chunk. The state is held as two halves along DK, and each
    [C, DK] operand loaded as two halves just before its dots, to keep the tf32x3 dots' split
    operands within the registers. Built for sm_90 at Dk = 128 with Triton 3.6 (the H200's),
    4 warps and 1 stage: 1,432 bytes of stack for spills (8 warps: 744, but 1.3-2.3x the time
    on the H200; 2 stages: 856; the whole [C, DK] operands: ~2 KiB). Short live ranges matter:
    masks built once per chunk and kept cost ~400 more bytes."""
    b, h, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = h // (HV // HK)
    start, end = tl.load(qsl_ptr + b), tl.load(qsl_ptr + b + 1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    HALF: tl.constexpr = BK // 2
    d0 = tl.arange(0, HALF)
    d1 = HALF + d0
    dv = block * BV + tl.arange(0, BV)
    m0, m1, mv = d0 < DK, d1 < DK, dv < DV
    state_at = states_ptr + (slot * HV + h) * DK * DV + dv[None, :]
    has_state = tl.load(has_state_ptr + b) != 0  # a garbage slot never leaks in
    s0 = tl.load(state_at + d0[:, None] * DV, mask=m0[:, None] & mv[None, :], other=0.0)
    s1 = tl.load(state_at + d1[:, None] * DV, mask=m1[:, None] & mv[None, :], other=0.0)
    s0, s1 = tl.where(has_state, s0, 0.0), tl.where(has_state, s1, 0.0)
    i = tl.arange(0, C)
    for first in range(start, end, C):
        rows = first + i
        live = rows < end
        at_w = (rows[:, None] * HV + h) * DK
        at_v = (rows[:, None] * HV + h) * DV + dv[None, :]
        mask_v = live[:, None] & mv[None, :]
        u = tl.load(u_ptr + at_v, mask=mask_v, other=0.0)
        w = tl.load(w_ptr + at_w + d0[None, :], mask=live[:, None] & m0[None, :], other=0.0)
        u -= tl.dot(w, s0, input_precision="tf32x3")
        w = tl.load(w_ptr + at_w + d1[None, :], mask=live[:, None] & m1[None, :], other=0.0)
        u -= tl.dot(w, s1, input_precision="tf32x3")
        out = tl.load(out_ptr + at_v, mask=mask_v, other=0.0)
        queries = tl.load(qs_ptr + at_w + d0[None, :], mask=live[:, None] & m0[None, :], other=0.0)
        out += tl.dot(queries, s0, input_precision="tf32x3")
        queries = tl.load(qs_ptr + at_w + d1[None, :], mask=live[:, None] & m1[None, :], other=0.0)
        out += tl.dot(queries, s1, input_precision="tf32x3")
        tl.store(out_ptr + at_v, out, mask=mask_v)
        at_k = (rows[:, None] * HK + hk) * DK
        k0 = tl.load(k_ptr + at_k + d0[None, :], mask=live[:, None] & m0[None, :], other=0.0).to(tl.float32)
        k1 = tl.load(k_ptr + at_k + d1[None, :], mask=live[:, None] & m1[None, :], other=0.0).to(tl.float32)
        norm = tl.rsqrt(tl.sum(k0 * k0, axis=1) + tl.sum(k1 * k1, axis=1) + 1e-6)
        cum = tl.load(cum_ptr + rows * HV + h, mask=live, other=0.0)
        last = tl.load(cum_ptr + (tl.minimum(first + C, end) - 1) * HV + h)
        to_end = tl.where(live, tl.exp(last - cum), 0.0) * norm  # k's L2 norm folded in
        s0 = tl.exp(last) * s0 + tl.dot(tl.trans(k0 * to_end[:, None]), u, input_precision="tf32x3")
        s1 = tl.exp(last) * s1 + tl.dot(tl.trans(k1 * to_end[:, None]), u, input_precision="tf32x3")
    tl.store(state_at + d0[:, None] * DV, s0, mask=m0[:, None] & mv[None, :])
    tl.store(state_at + d1[:, None] * DV, s1, mask=m1[:, None] & mv[None, :])


launch_gdn_chunk_local = DirectLauncher(_gdn_chunk_local_kernel)
launch_gdn_chunk_state = DirectLauncher(_gdn_chunk_state_kernel)


def gated_delta_rule_chunked_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                    beta: torch.Tensor, states: torch.Tensor, meta: RecurrentMetadata,
                                    chunk: int) -> torch.Tensor:
    """ops.recurrent.gated_delta_rule over chunks of `chunk` rows within each request of the flat
    batch, in two launches (the chunk-local WY/UT pieces, then the scan from chunk to chunk);
    no per-row states. Its checks ran in the caller. Scratch between the two: float32 W, Q'
    [T, Hv, Dk] and U0 [T, Hv, Dv], three times the output's size (at Qwen3-Next's heads,
    200 MB per 4,096 tokens of the step)."""
    tokens, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    device = q.device
    out = torch.empty(tokens, hv, dv, dtype=torch.float32, device=device)
    w = torch.empty(tokens, hv, dk, dtype=torch.float32, device=device)
    queries = torch.empty_like(w)
    u = torch.empty_like(out)
    cum = torch.empty(tokens, hv, dtype=torch.float32, device=device)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    block_k = max(32, triton.next_power_of_2(dk))  # tl.dot takes 16 or more: the state kernel's halves
    if chunk % SOLVE_BLOCK or chunk & (chunk - 1):
        raise ValueError(f"chunked gated delta rule: chunk {chunk} is not a power of 2 >= {SOLVE_BLOCK}")
    factors = max(1, (chunk // SOLVE_BLOCK).bit_length() - 1)  # of (I + N)^-1, N^(C / 16) = 0
    sizes = dict(HK=hk, HV=hv, DK=dk, DV=dv, C=chunk)
    # sm_90, Triton 3.6 (the H200's), Dk = Dv = 128: 64 KiB of shared memory and 968 bytes of
    # stack for spills at 4 warps (8 warps: 96 KiB and 168 bytes, yet 2.2x the time: 847 against
    # 390 us at 1 x 4096 tokens, Qwen3-Next's heads; RESULTS.md "gdn-tuning-s35")
    gpu: dict[str, int] = {"num_warps": 4} if q.is_cuda else {}
    launch_gdn_chunk_local((meta.num_reqs, triton.cdiv(meta.max_query_len, chunk), hv), q, k, v,
                           g.float().contiguous(), beta.float().contiguous(), meta.query_start_loc, w, u,
                           queries, cum, out, dk**-0.5, CB=COLUMN_BLOCK, SOLVE_BLOCK=SOLVE_BLOCK,
                           SOLVE_FACTORS=factors, **sizes, **gpu)
    block_v = max(16, min(VALUE_BLOCK, triton.next_power_of_2(dv)))
    gpu = {"num_warps": 4, "num_stages": 1} if q.is_cuda else {}  # fastest measured: see the kernel
    launch_gdn_chunk_state((meta.num_reqs, hv, triton.cdiv(dv, block_v)), k, w, u, queries, cum, out, states,
                           meta.query_start_loc, meta.state_slots, meta.has_state, BK=block_k, BV=block_v,
                           **sizes, **gpu)
    return out

"""The Triton Gumbel-max sampler: one pass over each row's logits, no noise tensor, no sort.

Stage 1: program (row, chunk) scores CHUNK = BLOCK * BLOCKS_PER_CHUNK tokens and keeps, per lane,
the best score and its lowest index; it writes the chunk's best (score, index). Stage 2: one
program per row reduces the chunks. Max and lowest-index-on-ties are exact, so the result does not
depend on BLOCK or on the chunking.

The noise mirrors noise.py operation for operation. Float ops are IEEE +, -, *, and div_rn, and
the kernels are compiled with enable_fp_fusion=False: a fused multiply-add rounds once where
PyTorch rounds twice, which would change the noise bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jackfield.sampling import noise

# Fastest of the shapes swept on the H200 (benchmarks/RESULTS.md, 2026-11-29).
DEFAULT_BLOCK = 1024
DEFAULT_BLOCKS_PER_CHUNK = 4
DEFAULT_NUM_WARPS = 4

# Kernels read module globals only as constexpr: the same float32 values noise.py uses.
_NO_INDEX = tl.constexpr(2**31 - 1)
_SQRT2 = tl.constexpr(noise.F32_SQRT2)
_LN2_HI = tl.constexpr(noise.F32_LN2_HI)
_LN2_LO = tl.constexpr(noise.F32_LN2_LO)
_ATANH3, _ATANH5, _ATANH7, _ATANH9 = (tl.constexpr(c) for c in noise.F32_ATANH_COEFFS)
_INV8, _INV7, _INV6, _INV5, _INV4, _INV3, _INV2, _INV1 = (tl.constexpr(c) for c in noise.F32_INV_K)
_MIN_ONE_MINUS_V = tl.constexpr(noise.F32_MIN_ONE_MINUS_V)


@triton.jit
def _mul32(a, c: tl.constexpr):
    return a * tl.full((), c, tl.uint32)


@triton.jit
def _rotl32(x, r: tl.constexpr):
    return (x << r) | (x >> (32 - r))


@triton.jit
def _mix_word(h, word):
    k = _mul32(_rotl32(_mul32(word, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ k, 13)
    return _mul32(h, 5) + tl.full((), 0xE6546B64, tl.uint32)


@triton.jit
def _log_f32(x):
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    big = m > _SQRT2
    m = tl.where(big, m * 0.5, m)
    e = tl.where(big, exponent + 1, exponent).to(tl.float32)
    s = tl.math.div_rn(m - 1.0, m + 1.0)
    z = s * s
    poly = _ATANH3 + z * (_ATANH5 + z * (_ATANH7 + z * _ATANH9))
    log_m = (s + s) + (s * z) * poly
    return e * _LN2_HI + (log_m + e * _LN2_LO)


@triton.jit
def _gumbel_f32(row_hash, token):
    """row_hash: the Murmur3 state after the first three words; token: uint32 ids."""
    h = _mix_word(row_hash, token)
    h = h ^ 16
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    r = h ^ (h >> 16)
    u = (r >> 16).to(tl.float32) * 1.52587890625e-05 + (
        (r & 0xFFFF).to(tl.float32) + 0.5
    ) * 2.3283064365386963e-10
    series = _INV7 + u * _INV8  # the Horner form of u + u^2/2 + ... + u^8/8
    series = _INV6 + u * series
    series = _INV5 + u * series
    series = _INV4 + u * series
    series = _INV3 + u * series
    series = _INV2 + u * series
    series = _INV1 + u * series
    series = -(u * series)
    clamped = tl.maximum(1.0 - u, _MIN_ONE_MINUS_V)
    log1p_neg = tl.where(u < 0.25, series, _log_f32(clamped))
    return -_log_f32(-log1p_neg)


@triton.jit
def _gumbel_argmax_chunks(
    logits_ptr, row_stride, temperature_ptr, seed_ptr, pos_ptr, cutoff_ptr,
    chunk_score_ptr, chunk_index_ptr, vocab, num_chunks,
    HAS_CUTOFF: tl.constexpr, BLOCK: tl.constexpr, BLOCKS_PER_CHUNK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_logits = logits_ptr + row.to(tl.int64) * row_stride
    temperature = tl.load(temperature_ptr + row)
    cutoff = float("-inf")
    if HAS_CUTOFF:
        cutoff = tl.load(cutoff_ptr + row)
    seed = tl.load(seed_ptr + row)
    h = tl.full((), 0, tl.uint32)
    h = _mix_word(h, seed.to(tl.uint32))
    h = _mix_word(h, (seed >> 32).to(tl.uint32))
    row_hash = _mix_word(h, tl.load(pos_ptr + row).to(tl.uint32))

    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_index = tl.full((BLOCK,), _NO_INDEX, tl.int32)
    start = chunk * BLOCK * BLOCKS_PER_CHUNK
    for b in tl.static_range(BLOCKS_PER_CHUNK):
        index = start + b * BLOCK + lanes
        in_vocab = index < vocab
        x = tl.load(row_logits + index, mask=in_vocab, other=float("-inf")).to(tl.float32)
        keep = in_vocab & (x == x) & (tl.abs(x) < float("inf")) & (x >= cutoff)
        if temperature == 0.0:
            score = x
        else:
            score = tl.math.div_rn(x, temperature) + _gumbel_f32(row_hash, index.to(tl.uint32))
        score = tl.where(keep, score, float("-inf"))
        better = score > best  # strict: an earlier index wins a tie within a lane
        best = tl.where(better, score, best)
        best_index = tl.where(better, index, best_index)

    top = tl.max(best, axis=0)
    top_index = tl.min(tl.where(best == top, best_index, _NO_INDEX), axis=0)
    top_index = tl.where(top_index == _NO_INDEX, start, top_index)  # nothing finite: the first token
    tl.store(chunk_score_ptr + row * num_chunks + chunk, top)
    tl.store(chunk_index_ptr + row * num_chunks + chunk, top_index)


@triton.jit
def _reduce_chunks(
    chunk_score_ptr, chunk_index_ptr, token_ptr, score_ptr, num_chunks, CHUNKS_POW2: tl.constexpr
):
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS_POW2)
    valid = c < num_chunks
    scores = tl.load(chunk_score_ptr + row * num_chunks + c, mask=valid, other=float("-inf"))
    indices = tl.load(chunk_index_ptr + row * num_chunks + c, mask=valid, other=_NO_INDEX)
    top = tl.max(scores, axis=0)
    top_index = tl.min(tl.where(valid & (scores == top), indices, _NO_INDEX), axis=0)
    tl.store(token_ptr + row, top_index.to(tl.int64))
    tl.store(score_ptr + row, top)


def gumbel_argmax_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    cutoff: torch.Tensor | None,
    block: int = DEFAULT_BLOCK,
    blocks_per_chunk: int = DEFAULT_BLOCKS_PER_CHUNK,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as gumbel_argmax_torch; logits [R, V] with unit stride along the vocab."""
    num_rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, block * blocks_per_chunk)
    device = logits.device
    chunk_score = torch.empty((num_rows, num_chunks), dtype=torch.float32, device=device)
    chunk_index = torch.empty((num_rows, num_chunks), dtype=torch.int32, device=device)
    token = torch.empty(num_rows, dtype=torch.int64, device=device)
    score = torch.empty(num_rows, dtype=torch.float32, device=device)
    if num_rows == 0:
        return token, score
    temperature = temperature.to(torch.float32)
    _gumbel_argmax_chunks[(num_rows, num_chunks)](
        logits, logits.stride(0), temperature, seeds, positions,
        cutoff if cutoff is not None else temperature, chunk_score, chunk_index, vocab, num_chunks,
        HAS_CUTOFF=cutoff is not None, BLOCK=block, BLOCKS_PER_CHUNK=blocks_per_chunk,
        num_warps=num_warps, enable_fp_fusion=False,
    )  # fmt: skip
    _reduce_chunks[(num_rows,)](
        chunk_score, chunk_index, token, score, num_chunks,
        CHUNKS_POW2=triton.next_power_of_2(num_chunks), num_warps=1, enable_fp_fusion=False,
    )  # fmt: skip
    return token, score

"""The Triton Gumbel-max sampler: approximate scores everywhere, exact scores where they can win.

Stage 1 (`_approx_chunk_max`, program per (row, chunk)) scores every token with a cheap
approximation of the exact score and writes each chunk's approximate maximum. Stage 2
(`_exact_rows`, program per row) takes M = the largest chunk maximum and recomputes EXACTLY (the
noise of noise.py, IEEE div_rn, no FMA fusion) only the chunks whose approximate maximum is
>= M - 2E, in index order with a strict >, so the lowest index wins ties. E bounds the error of the
approximation (see `_approx_error_bound`), so every chunk that can hold the exact winner is
recomputed: the result is the exact (token, score) of gumbel_torch.py, bit for bit, and does not
depend on BLOCK or the chunking. Typically one chunk per row is recomputed.

The approximate score of a token (stage 1, FMA fusion allowed):
  x * fl(1 / T) + noise~, noise~ = -ln(w~), w~ ~ -ln(1 - u) with u the exact uniform of noise.py,
  w~ = u (1 + u/2 + u^2/3 + u^3/4) for u < 1/16, else -ln(max(1 - u, 2^-24)), logs from the
  hardware log2 (lg2.approx on CUDA). About 40 SASS instructions per token instead of ~110.
Temperature-0 rows score the logit itself (exact in both stages).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

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
_LN2 = tl.constexpr(0.693147182464599609375)  # float32(ln 2)
_MAGIC = tl.constexpr(0x4B000000)  # float32 bits of 2^23: (MAGIC | n) is 2^23 + n for n < 2^23
_RELIABLE = tl.constexpr(2.0**64)  # |M| below this: no score near float32 overflow
# 1/(k ln 2), k = 1..4: the series of -ln(1 - u) in units of ln 2; -ln(ln 2) in float32.
_S1, _S2, _S3, _S4 = (tl.constexpr(float(np.float32(1.0 / (k * math.log(2))))) for k in (1, 2, 3, 4))
_NEG_LN_LN2 = tl.constexpr(float(np.float32(-math.log(math.log(2)))))


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
def _row_hash(seed_ptr, pos_ptr, row):
    """The Murmur3 state after the first three words (seed low, seed high, position)."""
    seed = tl.load(seed_ptr + row)
    h = tl.full((), 0, tl.uint32)
    h = _mix_word(h, seed.to(tl.uint32))
    h = _mix_word(h, (seed >> 32).to(tl.uint32))
    return _mix_word(h, tl.load(pos_ptr + row).to(tl.uint32))


@triton.jit
def _murmur3_last_word(row_hash, token):
    """murmur3_hash32 of noise.py from the row's state: the token word, then fmix (uint32)."""
    h = _mix_word(row_hash, token)
    h = h ^ 16
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


@triton.jit
def _uniform_from_hash(r):
    """uniform32_from_hash of noise.py: u = hi 2^-16 + (lo + 0.5) 2^-32, the same bits.

    hi and lo (< 2^16) become floats through the bits of 2^23 + n (no int-to-float conversion,
    which runs at a quarter of the rate): (2^23 + hi) 2^-16 - 128 = hi 2^-16 and
    (2^23 + lo) - (2^23 - 0.5) = lo + 0.5 are exact, so u has the same bits as in noise.py with or
    without FMA fusion (the final sum is the only rounding).
    """
    magic = tl.full((), _MAGIC, tl.uint32)
    hi_term = ((r >> 16) | magic).to(tl.float32, bitcast=True) * 1.52587890625e-05 - 128.0
    lo_half = ((r & 0xFFFF) | magic).to(tl.float32, bitcast=True) - 8388607.5
    return hi_term + lo_half * 2.3283064365386963e-10


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
def _gumbel_from_uniform(u):
    """The exact noise of noise.py (needs enable_fp_fusion=False)."""
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
def _gumbel_f32(row_hash, token):
    """The exact noise of token ids (uint32) for a row (needs enable_fp_fusion=False)."""
    return _gumbel_from_uniform(_uniform_from_hash(_murmur3_last_word(row_hash, token)))


@triton.jit
def _fast_log2(x, FAST_LOG: tl.constexpr):
    if FAST_LOG:  # lg2.approx.ftz.f32: |error| < 2^-22 absolute for normal inputs
        return libdevice.fast_log2f(x)
    else:  # the interpreter has no libdevice; its log2 is more accurate, which the bound covers
        return tl.log2(x)


@triton.jit
def _approx_log2_t(u, FAST_LOG: tl.constexpr):
    """log2(t) with t = w~ / ln 2, so that noise~ = -ln(w~) = -ln 2 * log2(t) - ln(ln 2).

    t = (u + u^2/2 + u^3/3 + u^4/4) / ln 2 for u < 1/16, else -log2(max(1 - u, 2^-24)).
    `approx_noise` gives noise~, within 2e-5 of the exact noise (see _approx_error_bound).
    """
    series = u * (_S1 + u * (_S2 + u * (_S3 + u * _S4)))
    neg_t = tl.where(u < 0.0625, -series, _fast_log2(tl.maximum(1.0 - u, _MIN_ONE_MINUS_V), FAST_LOG))
    return _fast_log2(-neg_t, FAST_LOG)


@triton.jit
def approx_noise(u, FAST_LOG: tl.constexpr):
    """noise~ of a uniform u, as stage 1 adds it (tests and the benchmark check its error)."""
    return _approx_log2_t(u, FAST_LOG) * -_LN2 + _NEG_LN_LN2


@triton.jit
def _approx_error_bound(m):
    """E(M): a bound on |approx - exact| for every score that can come within E of M.

    Per token with exact score s = fl(y + g), y = div_rn(x, T), g the exact noise of noise.py:
    - temperature: x * fl(1/T) has two roundings, div_rn one: |y~ - y| <= 3 * 2^-24 |x/T|.
    - noise: noise~ = -ln 2 * log2(t) - ln(ln 2) (float32 constants) with w~ = t ln 2 close to
      w = -ln(1 - u). Relative error of w~: the series' tail u^4 / (5 (1 - u)) <= 3.3e-6 for
      u < 1/16; above, fl(1 - u) is within 2^-24 of 1 - u and |ln(1 - u)| >= ln(16/15) = 0.0645,
      so lg2.approx's absolute error (2^-22.6 documented, taken as 2^-21) is <= 5.1e-6; constants
      and roundings add < 5e-7. The outer log adds 2^-21 ln 2, ln 2's rounding times
      |log2 t| <= 34 adds 7e-7, the last roundings 23 * 2^-23. The exact noise is within 1e-5 of
      -ln(-ln(1 - u)) (8-term series, log_f32 within 2 ulps). So |noise~ - g| < 1.9e-5 (checked
      over all 2^32 hashes on the GPU by benchmarks/bench_sampler.py). The noise lies in
      [-2.82, 22.9].
    - the sum: one rounding each, <= 2^-24 |s| plus ulp slack.
    So |s~ - s| <= 2e-5 + 2^-21 (|s| + 24) =: e(s). Two tokens whose scores lie within e of M
    have |s| <= |M| (1 + 2^-20) + 1, and e(s1) + e(s2) < 2 E(M) with
    E(M) = 1e-4 + 2^-16 (|M| + 32): a margin of 2.5x on the constant and 16x on the slope.
    """
    return 1e-4 + 1.52587890625e-05 * (tl.abs(m) + 32.0)


@triton.jit
def _approx_chunk_max(
    logits_ptr, row_stride, temperature_ptr, seed_ptr, pos_ptr, cutoff_ptr, skip_ptr,
    chunk_max_ptr, vocab, num_chunks,
    HAS_CUTOFF: tl.constexpr, HAS_SKIP: tl.constexpr, BLOCK: tl.constexpr,
    BLOCKS_PER_CHUNK: tl.constexpr, FAST_LOG: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if HAS_SKIP:
        if tl.load(skip_ptr + row) != 0:
            return
    row_logits = logits_ptr + row.to(tl.int64) * row_stride
    temperature = tl.load(temperature_ptr + row)
    inv_t = 1.0 / tl.where(temperature == 0.0, 1.0, temperature)  # T = 0 scores the logits
    cutoff = float("-inf")
    if HAS_CUTOFF:
        cutoff = tl.load(cutoff_ptr + row)
    row_hash = _row_hash(seed_ptr, pos_ptr, row)

    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    start = chunk * BLOCK * BLOCKS_PER_CHUNK
    for b in tl.static_range(BLOCKS_PER_CHUNK):
        index = start + b * BLOCK + lanes
        x = tl.load(row_logits + index, mask=index < vocab, other=float("-inf")).to(tl.float32)
        if temperature == 0.0:
            score = tl.where(tl.abs(x) < float("inf"), x, float("-inf"))  # exact: +inf excluded
        else:
            # NaN logits give NaN scores, which tl.maximum ignores; +inf gives M = +inf, which
            # stage 2 answers by recomputing the whole row. So no finite-mask here.
            u = _uniform_from_hash(_murmur3_last_word(row_hash, index.to(tl.uint32)))
            score = _approx_log2_t(u, FAST_LOG) * -_LN2 + (x * inv_t + _NEG_LN_LN2)
        if HAS_CUTOFF:
            score = tl.where(x >= cutoff, score, float("-inf"))
        best = tl.maximum(best, score)
    tl.store(chunk_max_ptr + row * num_chunks + chunk, tl.max(best, axis=0))


@triton.jit
def _exact_rows(
    logits_ptr, row_stride, temperature_ptr, seed_ptr, pos_ptr, cutoff_ptr, skip_ptr,
    chunk_max_ptr, token_ptr, score_ptr, vocab, num_chunks,
    HAS_CUTOFF: tl.constexpr, HAS_SKIP: tl.constexpr, BLOCK: tl.constexpr,
    BLOCKS_PER_CHUNK: tl.constexpr, CHUNKS_POW2: tl.constexpr,
):  # fmt: skip
    """Compile with enable_fp_fusion=False: these are the exact scores of gumbel_torch.py."""
    row = tl.program_id(0)
    if HAS_SKIP:
        if tl.load(skip_ptr + row) != 0:
            return
    row_logits = logits_ptr + row.to(tl.int64) * row_stride
    temperature = tl.load(temperature_ptr + row)
    cutoff = float("-inf")
    if HAS_CUTOFF:
        cutoff = tl.load(cutoff_ptr + row)
    row_hash = _row_hash(seed_ptr, pos_ptr, row)

    chunks = tl.arange(0, CHUNKS_POW2)
    in_row = chunks < num_chunks
    approx = tl.load(chunk_max_ptr + row * num_chunks + chunks, mask=in_row, other=float("-inf"))
    m = tl.max(approx, axis=0)
    if temperature == 0.0:
        threshold = m  # stage 1 scored the logits themselves: exact (-inf: every chunk)
    else:
        threshold = m - 2.0 * _approx_error_bound(m)
        # No finite M (nothing kept, overflow, x * inf from a subnormal T): recompute every chunk.
        threshold = tl.where(tl.abs(m) < _RELIABLE, threshold, float("-inf"))
    candidate = in_row & (approx >= threshold)  # stage 1's maxima are never NaN (tl.maximum)

    lanes = tl.arange(0, BLOCK)
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), _NO_INDEX, tl.int32)
    chunk = tl.min(tl.where(candidate, chunks, CHUNKS_POW2), axis=0)
    while chunk < num_chunks:
        for b in tl.static_range(BLOCKS_PER_CHUNK):
            index = (chunk * BLOCKS_PER_CHUNK + b) * BLOCK + lanes
            in_vocab = index < vocab
            x = tl.load(row_logits + index, mask=in_vocab, other=float("-inf")).to(tl.float32)
            keep = in_vocab & (x == x) & (tl.abs(x) < float("inf")) & (x >= cutoff)
            if temperature == 0.0:
                score = x
            else:
                score = tl.math.div_rn(x, temperature) + _gumbel_f32(row_hash, index.to(tl.uint32))
            score = tl.where(keep, score, float("-inf"))
            top = tl.max(score, axis=0)
            top_index = tl.min(tl.where(score == top, index, _NO_INDEX), axis=0)
            better = top > best  # strict, blocks in index order: the lowest index wins ties
            best_index = tl.where(better, top_index, best_index)
            best = tl.where(better, top, best)
        chunk = tl.min(tl.where(candidate & (chunks > chunk), chunks, CHUNKS_POW2), axis=0)
    best_index = tl.where(best_index == _NO_INDEX, 0, best_index)  # nothing finite: token 0
    tl.store(token_ptr + row, best_index.to(tl.int64))
    tl.store(score_ptr + row, best)


def gumbel_argmax_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    cutoff: torch.Tensor | None,
    block: int = DEFAULT_BLOCK,
    blocks_per_chunk: int = DEFAULT_BLOCKS_PER_CHUNK,
    num_warps: int = DEFAULT_NUM_WARPS,
    skip: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as gumbel_argmax_torch; logits [R, V] with unit stride along the vocab.

    skip (uint8 [R], optional): rows left as they are in `out` (already sampled elsewhere).
    """
    num_rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, block * blocks_per_chunk)
    device = logits.device
    if out is None:
        out = (
            torch.empty(num_rows, dtype=torch.int64, device=device),
            torch.empty(num_rows, dtype=torch.float32, device=device),
        )
    token, score = out
    if num_rows == 0:
        return token, score
    chunk_max = torch.empty((num_rows, num_chunks), dtype=torch.float32, device=device)
    temperature = temperature.to(torch.float32)
    common = dict(
        HAS_CUTOFF=cutoff is not None,
        HAS_SKIP=skip is not None,
        BLOCK=block,
        BLOCKS_PER_CHUNK=blocks_per_chunk,
    )
    rows = (logits, logits.stride(0), temperature, seeds, positions)
    cutoff_arg = cutoff if cutoff is not None else temperature
    skip_arg = skip if skip is not None else temperature
    _approx_chunk_max[(num_rows, num_chunks)](
        *rows, cutoff_arg, skip_arg, chunk_max, vocab, num_chunks,
        FAST_LOG=device.type == "cuda", num_warps=num_warps, **common,
    )  # fmt: skip
    _exact_rows[(num_rows,)](
        *rows, cutoff_arg, skip_arg, chunk_max, token, score, vocab, num_chunks,
        CHUNKS_POW2=triton.next_power_of_2(num_chunks), num_warps=num_warps, enable_fp_fusion=False, **common,
    )  # fmt: skip
    return token, score

"""The Triton Gumbel-max sampler: approximate scores everywhere, exact scores where they can win.

Stage 1 (`_approx_maxima`, program per (group of rows, sub-blocks of the vocabulary)) scores every
token with a cheap approximation of the exact score and writes the approximate maximum of each
sub-block (1024 tokens by default). Stage 2 (`_exact_rows`, program per row) takes M = the row's
largest sub-block maximum and recomputes EXACTLY (the noise of noise.py, IEEE div_rn, no FMA
fusion) only the sub-blocks whose approximate maximum is >= M - 2E, in index order with a strict
>, so the lowest index wins ties. E bounds the error of the approximation (see
`_approx_error_bound`), so every sub-block that can hold the exact winner is recomputed: the result
is the exact (token, score) of gumbel_torch.py, bit for bit, and does not depend on the launch
shape. Typically one sub-block per row is recomputed.

The approximate score of a token (stage 1, FMA fusion allowed), in log2 units:
  x * fl(fl(1/T) log2 e) - log2(t), t = w~ / ln 2, w~ ~ -ln(1 - u) with u the exact uniform of
  noise.py: w~ = u (1 + u/2 + u^2/3) for u < 1/32, else -ln(max(1 - u, 2^-24)), logs from the
  hardware log2 (lg2.approx on CUDA); each sub-block maximum m becomes ln 2 * m - ln(ln 2), the
  natural-unit score (noise~ = -ln w~). The hash's token word is not recomputed per row: Murmur3
  mixes it as rotl(h ^ k, 13) = rotl(h, 13) ^ rotl(k, 13), so a per-device table holds
  rotl(k, 13) of every token id (`token_table`, L2-resident, shared by the rows of a program) and
  a row needs only rotl(h, 13). About 24 SASS instructions per token (sm_90) instead of ~110.
Temperature-0 rows go through the same code with 2^64 in place of log2(e) / T, so that the noise
is lost in the rounding of 2^64 x (stage 2 allows for it; see _approx_maxima); stage 2 scores
their logits themselves, exactly.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from jackfield.ops.launch import DirectLauncher
from jackfield.sampling import noise
from jackfield.sampling.sanitize import F32_MAX, GREEDY_BELOW


def _f32(x: float) -> float:
    """x rounded to float32 (as a Python float)."""
    return float(torch.tensor(x, dtype=torch.float32))


# Kernels read module globals only as constexpr: the same float32 values noise.py uses.
_NO_INDEX = tl.constexpr(2**31 - 1)
_SQRT2 = tl.constexpr(noise.F32_SQRT2)
_LN2_HI = tl.constexpr(noise.F32_LN2_HI)
_LN2_LO = tl.constexpr(noise.F32_LN2_LO)
_ATANH3, _ATANH5, _ATANH7, _ATANH9 = (tl.constexpr(c) for c in noise.F32_ATANH_COEFFS)
_INV8, _INV7, _INV6, _INV5, _INV4, _INV3, _INV2, _INV1 = (tl.constexpr(c) for c in noise.F32_INV_K)
_MIN_ONE_MINUS_V = tl.constexpr(noise.F32_MIN_ONE_MINUS_V)
_LN2 = tl.constexpr(0.693147182464599609375)  # float32(ln 2)
_LOG2E = tl.constexpr(1.44269502162933349609375)  # float32(log2 e)
_MAGIC = tl.constexpr(0x4B000000)  # float32 bits of 2^23: (MAGIC | n) is 2^23 + n for n < 2^23
_RELIABLE = tl.constexpr(2.0**64)  # |M| below this: no score near float32 overflow
_GREEDY_SCALE = tl.constexpr(2.0**64)  # stage 1's factor on a greedy row's logits (see _approx_maxima)
_GREEDY_RELIABLE = tl.constexpr(2.0**126)  # a greedy row's |M| below this: no logit near overflow
# 1/(k ln 2), k = 1..3: the series of -ln(1 - u) in units of ln 2; -ln(ln 2) in float32.
_S1, _S2, _S3 = (tl.constexpr(_f32(1.0 / (k * math.log(2)))) for k in (1, 2, 3))
_NEG_LN_LN2 = tl.constexpr(_f32(-math.log(math.log(2))))
_GREEDY_BELOW = tl.constexpr(GREEDY_BELOW)
_F32_MAX = tl.constexpr(F32_MAX)


@triton.jit
def load_temperature(temperature_ptr, rows):
    """Temperatures as sanitize.py defines them (below GREEDY_BELOW, negative or NaN: 0, greedy;
    +inf: the largest float32), applied as the kernels load them: no launches to sanitize."""
    t = tl.load(temperature_ptr + rows)
    return tl.minimum(tl.where(t >= _GREEDY_BELOW, t, 0.0), _F32_MAX)


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
def _uniform_from_magic_bits(hi_bits, lo_bits):
    """uniform32_from_hash of noise.py from hi_bits = (r >> 16) | MAGIC and lo_bits = (r & 0xFFFF) |
    MAGIC: u = hi 2^-16 + (lo + 0.5) 2^-32, the same bits.

    hi and lo (< 2^16) become floats through the bits of 2^23 + n (no int-to-float conversion,
    which runs at a quarter of the rate): (2^23 + hi) 2^-16 - 128 = hi 2^-16 and
    (2^23 + lo) - (2^23 - 0.5) = lo + 0.5 are exact, so u has the same bits as in noise.py with or
    without FMA fusion (the final sum is the only rounding).
    """
    hi_term = hi_bits.to(tl.float32, bitcast=True) * 1.52587890625e-05 - 128.0
    lo_half = lo_bits.to(tl.float32, bitcast=True) - 8388607.5
    return hi_term + lo_half * 2.3283064365386963e-10


@triton.jit
def _uniform_from_hash(r):
    """uniform32_from_hash of noise.py (see _uniform_from_magic_bits)."""
    magic = tl.full((), _MAGIC, tl.uint32)
    return _uniform_from_magic_bits((r >> 16) | magic, (r & 0xFFFF) | magic)


@triton.jit
def _uniform_before_last_shift(h):
    """_uniform_from_hash(h ^ (h >> 16)), the last step of fmix folded in: with r = h ^ (h >> 16),
    r >> 16 = h >> 16 and r & 0xFFFF = (h ^ (h >> 16)) & 0xFFFF, so hi_bits = (h >> 16) + MAGIC
    (one LEA.HI on sm_90) and lo_bits = hi_bits ^ (h & 0xFFFF) (one LOP3): 2 instructions
    instead of 4 for the two halves."""
    hi_bits = (h >> 16) + tl.full((), _MAGIC, tl.uint32)
    return _uniform_from_magic_bits(hi_bits, hi_bits ^ (h & 0xFFFF))


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

    t = (u + u^2/2 + u^3/3) / ln 2 for u < 1/32, else -log2(max(1 - u, 2^-24)).
    `approx_noise` gives noise~, within 3e-5 of the exact noise (see _approx_error_bound).
    """
    series = u * (_S1 + u * (_S2 + u * _S3))
    neg_t = tl.where(u < 0.03125, -series, _fast_log2(tl.maximum(1.0 - u, _MIN_ONE_MINUS_V), FAST_LOG))
    return _fast_log2(-neg_t, FAST_LOG)


@triton.jit
def approx_noise(u, FAST_LOG: tl.constexpr):
    """noise~ of a uniform u, as stage 1 adds it (tests and the benchmark check its error)."""
    return _approx_log2_t(u, FAST_LOG) * -_LN2 + _NEG_LN_LN2


@triton.jit
def _approx_error_bound(m):
    """E(M): a bound on |approx - exact| for every score that can come within E of M.

    Per token with exact score s = fl(y + g), y = div_rn(x, T), g the exact noise of noise.py:
    - temperature: the stage-1 factor fl(fl(1/T) fl(log2 e)) times fl(ln 2) is within 5 * 2^-24
      of 1/T, and the product with x is rounded inside one FFMA: |y~ - y| <= 2^-21 |x/T|.
    - noise: noise~ = -ln 2 * log2(t) - ln(ln 2) (float32 constants) with w~ = t ln 2 close to
      w = -ln(1 - u). Relative error of w~: the series' tail u^3 / (4 (1 - u)) <= 7.9e-6 for
      u < 1/32; above, fl(1 - u) is within 2^-25 of 1 - u and |log2(1 - u)| >= log2(32/31) =
      0.0458, so lg2.approx's absolute error (2^-22.6 documented, taken as 2^-21) is <= 1.1e-5;
      constants and roundings add < 2e-6. The outer log adds 2^-21 ln 2, ln 2's rounding times
      |log2 t| <= 34 adds 7e-7, the last roundings 23 * 2^-23. The exact noise is within 1e-5 of
      -ln(-ln(1 - u)) (8-term series, log_f32 within 2 ulps). So |noise~ - g| < 3e-5 (checked
      over all 2^32 hashes on the GPU by benchmarks/bench_sampler.py). The noise lies in
      [-2.82, 22.9].
    - the score: one rounding in the FFMA (units of log2, 2^-24 (|s| + 1) after the conversion),
      two in the conversion of the maximum (2^-23 (|s| + 1)).
    So |s~ - s| <= 3e-5 + 2^-20 (|s| + 24) =: e(s). Two tokens whose scores lie within e of M
    have |s| <= |M| (1 + 2^-19) + 1, and e(s1) + e(s2) < 2 E(M) with
    E(M) = 1e-4 + 2^-16 (|M| + 32): a margin of 3x on the constant and 16x on the slope.
    """
    return 1e-4 + 1.52587890625e-05 * (tl.abs(m) + 32.0)


@triton.jit
def _step_scores(x, r13, k13, scale, FAST_LOG: tl.constexpr):
    """Approximate scores of a [ROWS, STEP] tile in log2 units: x * scale - log2(t) (see module).

    r13 [ROWS] and k13 [STEP] are the two halves of the Murmur3 state after the token word:
    rotl(h ^ k, 13) = rotl(h, 13) ^ rotl(k, 13), so only the XOR is left per token. Greedy rows
    have scale = GREEDY_SCALE (see _approx_maxima).
    """
    h = _mul32(r13[:, None] ^ k13[None, :], 5) + tl.full((), 0xE6546B64, tl.uint32)
    h = h ^ 16
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    u = _uniform_before_last_shift(h)
    return x * scale[:, None] - _approx_log2_t(u, FAST_LOG)  # one FFMA


@triton.jit
def _approx_chunk(
    row_logits, r13, scale, greedy, cutoff, table_ptr, maxima_ptr, rows, live, vocab, num_sub, first_sub,
    HAS_CUTOFF: tl.constexpr, SUB: tl.constexpr, STEP: tl.constexpr, SUBS: tl.constexpr,
    MASKED: tl.constexpr, FAST_LOG: tl.constexpr,
):  # fmt: skip
    """Stage 1 over SUBS sub-blocks of SUB tokens for a group of rows: one maximum per (row,
    sub-block), the approximate score of the module docstring (natural units; greedy rows:
    GREEDY_SCALE times the logit, see _approx_maxima)."""
    lanes = tl.arange(0, STEP)
    for s in tl.static_range(SUBS):
        sub = first_sub + s
        for j in tl.static_range(SUB // STEP):
            index = sub * SUB + j * STEP + lanes
            k13 = tl.load(table_ptr + index).to(tl.uint32, bitcast=True)  # padded: never masked
            if MASKED:
                x = tl.load(row_logits + index[None, :], mask=(index < vocab)[None, :], other=float("-inf"))
            else:
                x = tl.load(row_logits + index[None, :], eviction_policy="evict_first")
            x = x.to(tl.float32)
            score = _step_scores(x, r13, k13, scale, FAST_LOG)
            if HAS_CUTOFF:
                score = tl.where(x >= cutoff[:, None], score, float("-inf"))
            # NaN logits give NaN scores, which tl.maximum ignores; +inf gives M = +inf, which
            # stage 2 answers by recomputing the whole row. So no finite-mask here.
            if j == 0:
                best = score  # not max(-inf, score): saves a move and a max per element
            else:
                best = tl.maximum(best, score)
        m = tl.max(best, axis=1)
        m = tl.where(greedy, m, m * _LN2 + _NEG_LN_LN2)  # log2 units -> the approximate score
        if sub < num_sub:
            tl.store(maxima_ptr + rows * num_sub + sub, m, mask=live)


@triton.jit
def _approx_maxima(
    logits_ptr, row_stride, temperature_ptr, seed_ptr, pos_ptr, cutoff_ptr, skip_ptr, table_ptr,
    maxima_ptr, num_rows, vocab, num_sub,
    HAS_CUTOFF: tl.constexpr, HAS_SKIP: tl.constexpr, ROWS: tl.constexpr, SUB: tl.constexpr,
    STEP: tl.constexpr, SUBS: tl.constexpr, FAST_LOG: tl.constexpr, OVERLAP: tl.constexpr,
):  # fmt: skip
    """Stage 1: program per (group of ROWS rows, SUBS sub-blocks); the rows share the table loads.

    Greedy rows take the same path as sampled ones, with scale = GREEDY_SCALE: their score
    x * 2^64 - log2(t) is 2^64 x within 34 + 2^-24 |score| (|log2 t| < 34), which stage 2's
    greedy bound covers; one code path keeps the kernel at 64 registers (a separate path for
    groups holding a greedy row took 103, and so 19 instead of 32 programs per SM).

    OVERLAP (CUDA): stage 2, launched as a programmatic dependent launch, may start once every
    program of this launch has started (it waits for this launch's results before reading them).
    """
    if OVERLAP:
        gdc_launch_dependents()
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    live = rows < num_rows
    rows = tl.minimum(rows, num_rows - 1)  # the last group repeats a row: loads need no row mask
    if HAS_SKIP:
        if tl.min(tl.load(skip_ptr + rows), axis=0) != 0:  # every row already sampled
            return
    temperature = load_temperature(temperature_ptr, rows)
    greedy = temperature == 0.0
    # 1/T (Triton's `/` may be the approximate division: <= 2 ulp), then times log2(e) rounded:
    # within ~2^-21 of log2(e)/T; the bound E allows 2^-20
    scale = tl.where(greedy, _GREEDY_SCALE, (1.0 / tl.where(greedy, 1.0, temperature)) * _LOG2E)
    r13 = _rotl32(_row_hash(seed_ptr, pos_ptr, rows), 13)
    cutoff = tl.full((ROWS,), float("-inf"), tl.float32)
    if HAS_CUTOFF:
        cutoff = tl.load(cutoff_ptr + rows)
    row_logits = logits_ptr + rows.to(tl.int64)[:, None] * row_stride
    first_sub = tl.program_id(0) * SUBS
    # Two copies of the chunk loop: the last chunk masks the vocabulary, the others do not.
    if (first_sub + SUBS) * SUB > vocab:
        _approx_chunk(
            row_logits, r13, scale, greedy, cutoff, table_ptr, maxima_ptr, rows, live, vocab, num_sub,
            first_sub, HAS_CUTOFF, SUB, STEP, SUBS, MASKED=True, FAST_LOG=FAST_LOG,
        )  # fmt: skip
    else:
        _approx_chunk(
            row_logits, r13, scale, greedy, cutoff, table_ptr, maxima_ptr, rows, live, vocab, num_sub,
            first_sub, HAS_CUTOFF, SUB, STEP, SUBS, MASKED=False, FAST_LOG=FAST_LOG,
        )  # fmt: skip


@triton.jit
def _exact_rows(
    logits_ptr, row_stride, temperature_ptr, seed_ptr, pos_ptr, cutoff_ptr, skip_ptr,
    maxima_ptr, token_ptr, score_ptr, vocab, num_sub,
    HAS_CUTOFF: tl.constexpr, HAS_SKIP: tl.constexpr, SUB: tl.constexpr, SUBS_POW2: tl.constexpr,
    OVERLAP: tl.constexpr,
):  # fmt: skip
    """Stage 2. Compile with enable_fp_fusion=False: these are the exact scores of gumbel_torch.py.

    OVERLAP: launched as a programmatic dependent launch of stage 1, so this program may run
    while stage 1 finishes: it reads only inputs written before stage 1 until gdc_wait()."""
    row = tl.program_id(0)
    if HAS_SKIP:
        if tl.load(skip_ptr + row) != 0:
            return
    row_logits = logits_ptr + row.to(tl.int64) * row_stride
    temperature = load_temperature(temperature_ptr, row)
    cutoff = float("-inf")
    if HAS_CUTOFF:
        cutoff = tl.load(cutoff_ptr + row)
    row_hash = _row_hash(seed_ptr, pos_ptr, row)
    if OVERLAP:
        gdc_wait()  # stage 1's maxima (and, past them, the outputs) from here on

    subs = tl.arange(0, SUBS_POW2)
    in_row = subs < num_sub
    approx = tl.load(maxima_ptr + row * num_sub + subs, mask=in_row, other=float("-inf"))
    m = tl.max(approx, axis=0)
    if temperature == 0.0:
        # Stage 1 scored 2^64 x - log2(t), |log2 t| < 34: within 34 + 2^-24 |m| of 2^64 x (the
        # argument of _approx_error_bound with these terms). No finite M, or logits near
        # 2^64 (overflow): recompute everything.
        threshold = m - 2.0 * (64.0 + 2.384185791015625e-07 * tl.abs(m))
        threshold = tl.where(tl.abs(m) < _GREEDY_RELIABLE, threshold, float("-inf"))
    else:
        threshold = m - 2.0 * _approx_error_bound(m)
        # No finite M (nothing kept, overflow, x * inf from a subnormal T): recompute everything.
        threshold = tl.where(tl.abs(m) < _RELIABLE, threshold, float("-inf"))
    candidate = in_row & (approx >= threshold)  # a NaN maximum (all-NaN sub-block) is no candidate

    lanes = tl.arange(0, SUB)
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), _NO_INDEX, tl.int32)
    sub = tl.min(tl.where(candidate, subs, SUBS_POW2), axis=0)
    while sub < num_sub:
        index = sub * SUB + lanes
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
        better = top > best  # strict, sub-blocks in index order: the lowest index wins ties
        best_index = tl.where(better, top_index, best_index)
        best = tl.where(better, top, best)
        sub = tl.min(tl.where(candidate & (subs > sub), subs, SUBS_POW2), axis=0)
    best_index = tl.where(best_index == _NO_INDEX, 0, best_index)  # nothing finite: token 0
    tl.store(token_ptr + row, best_index.to(tl.int64))
    tl.store(score_ptr + row, best)


@dataclass(frozen=True)
class LaunchShape:
    """How the two stages split the work; tokens and scores do not depend on it (tests vary it).

    sub_block: tokens per stage-1 maximum, the unit stage 2 recomputes exactly.
    step: tokens per row per stage-1 iteration (at most sub_block; sets the register tile).
    rows_per_program: rows of a stage-1 program; they share each load of the token table.
    sub_blocks_per_program: sub-blocks a stage-1 program covers.
    num_warps / exact_warps: warps of a stage-1 / stage-2 program.
    max_registers: a cap on stage 1's registers per thread (more programs per SM), or None.
    overlap_stages: on CUDA, launch stage 2 as a programmatic dependent launch of stage 1, so
        that its launch and its loads of per-row inputs overlap stage 1's last programs.
    """

    sub_block: int = 1024
    step: int = 256
    rows_per_program: int = 2
    sub_blocks_per_program: int = 1
    num_warps: int = 1
    exact_warps: int = 4
    max_registers: int | None = None
    overlap_stages: bool = True

    def __post_init__(self) -> None:
        for name in (
            "sub_block",
            "step",
            "rows_per_program",
            "sub_blocks_per_program",
            "num_warps",
            "exact_warps",
        ):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"LaunchShape.{name} must be a power of two, got {value}")
        if self.step > self.sub_block:
            raise ValueError(f"LaunchShape.step ({self.step}) must not exceed sub_block ({self.sub_block})")

    def with_sub_block(self, sub_block: int) -> LaunchShape:
        return replace(self, sub_block=sub_block, step=min(self.step, sub_block))


launch_approx_maxima = DirectLauncher(_approx_maxima)
launch_exact_rows = DirectLauncher(_exact_rows)


# Fastest of the shapes swept on the H200 (benchmarks/RESULTS.md, 2026-11-29).
DEFAULT_SHAPE = LaunchShape()

# One table per device, grown to the longest vocabulary seen (so never more than one of them).
_TOKEN_TABLES: dict[torch.device, torch.Tensor] = {}
_TABLE_ROUNDING = 1 << 16


MAX_GRID_Y = 65535  # CUDA's limit on a launch grid's y (and z) extent


@functools.cache
def _has_grid_dependency_control(device: torch.device) -> bool:
    """griddepcontrol (programmatic dependent launch) is a PTX instruction of sm_90 and later:
    ptxas rejects the kernel below that."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def _overlaps(shape: LaunchShape, logits: torch.Tensor) -> bool:
    """Whether stage 2 is a programmatic dependent launch of stage 1: CUDA on compute capability
    >= 9.0 (the interpreter has no grid dependency control)."""
    return shape.overlap_stages and logits.is_cuda and _has_grid_dependency_control(logits.device)


def token_table(length: int, device: torch.device) -> torch.Tensor:
    """int32 [>= length]: entry t holds the bits of rotl(rotl(t * c1, 15) * c2, 13), the token
    word of Murmur3 scrambled and rotated (the row half is rotl(h, 13)); cached per device."""
    table = _TOKEN_TABLES.get(device)
    if table is not None and table.numel() >= length:
        return table
    padded = triton.cdiv(length, _TABLE_ROUNDING) * _TABLE_ROUNDING
    token = torch.arange(padded, dtype=torch.int64, device=device)
    k = noise.scrambled_word(token)
    k13 = ((k << 13) | (k >> 19)) & noise.MASK32
    table = (k13 - ((k13 >> 31) << 32)).to(torch.int32)  # the same 32 bits, as int32
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        _TOKEN_TABLES[device] = table  # a table built inside a CUDA graph capture is not kept
    return table


def approx_maxima(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    cutoff: torch.Tensor | None,
    shape: LaunchShape = DEFAULT_SHAPE,
    skip: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stage 1: float32 [R, cdiv(V, sub_block)], the approximate maximum of each sub-block."""
    num_rows, vocab = logits.shape
    num_sub = triton.cdiv(vocab, shape.sub_block)
    chunks = triton.cdiv(num_sub, shape.sub_blocks_per_program)
    table = token_table(chunks * shape.sub_blocks_per_program * shape.sub_block, logits.device)
    maxima = torch.empty((num_rows, num_sub), dtype=torch.float32, device=logits.device)
    launch_approx_maxima(
        (chunks, triton.cdiv(num_rows, shape.rows_per_program)),
        logits, logits.stride(0), temperature, seeds, positions,
        cutoff if cutoff is not None else temperature, skip if skip is not None else temperature,
        table, maxima, num_rows, vocab, num_sub,
        HAS_CUTOFF=cutoff is not None, HAS_SKIP=skip is not None, ROWS=shape.rows_per_program,
        SUB=shape.sub_block, STEP=shape.step, SUBS=shape.sub_blocks_per_program,
        FAST_LOG=logits.device.type == "cuda", OVERLAP=_overlaps(shape, logits),
        num_warps=shape.num_warps, maxnreg=shape.max_registers,
    )  # fmt: skip
    return maxima


def exact_from_maxima(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    cutoff: torch.Tensor | None,
    maxima: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor],
    shape: LaunchShape = DEFAULT_SHAPE,
    skip: torch.Tensor | None = None,
) -> None:
    """Stage 2: the exact (token, score) of each row into `out`, from stage 1's maxima."""
    num_rows, vocab = logits.shape
    num_sub = maxima.shape[1]
    overlap = _overlaps(shape, logits)
    # launch_pdl only for an overlapped launch: the interpreter takes no CUDA launch options
    dependent_launch = {"launch_pdl": True} if overlap else {}
    launch_exact_rows(
        (num_rows,),
        logits, logits.stride(0), temperature, seeds, positions,
        cutoff if cutoff is not None else temperature, skip if skip is not None else temperature,
        maxima, out[0], out[1], vocab, num_sub,
        HAS_CUTOFF=cutoff is not None, HAS_SKIP=skip is not None, SUB=shape.sub_block,
        SUBS_POW2=triton.next_power_of_2(num_sub), OVERLAP=overlap,
        num_warps=shape.exact_warps, enable_fp_fusion=False, **dependent_launch,
    )  # fmt: skip


def _new_out(num_rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty(num_rows, dtype=torch.int64, device=device),
        torch.empty(num_rows, dtype=torch.float32, device=device),
    )


def gumbel_argmax_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    cutoff: torch.Tensor | None,
    shape: LaunchShape = DEFAULT_SHAPE,
    skip: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as gumbel_argmax_torch; logits [R, V] with unit stride along the vocab.

    skip (uint8 [R], optional): rows left as they are in `out` (already sampled elsewhere).
    """
    num_rows = logits.shape[0]
    temperature = temperature.to(torch.float32)
    # Stage 1's rows run along the grid's y axis, which CUDA caps at MAX_GRID_Y programs: larger
    # batches go in slices (views: the kernels address rows from each tensor's own start).
    per_launch = MAX_GRID_Y * shape.rows_per_program
    if 0 < num_rows <= per_launch:  # the usual case: no slicing (views cost host time)
        maxima = approx_maxima(logits, temperature, seeds, positions, cutoff, shape, skip)
        out = out if out is not None else _new_out(num_rows, logits.device)  # while stage 1 runs
        exact_from_maxima(logits, temperature, seeds, positions, cutoff, maxima, out, shape, skip)
        return out
    out = out if out is not None else _new_out(num_rows, logits.device)
    for r0 in range(0, num_rows, per_launch):
        rows = slice(r0, min(num_rows, r0 + per_launch))
        part = [t[rows] if t is not None else None
                for t in (logits, temperature, seeds, positions, cutoff, skip)]
        part_out = (out[0][rows], out[1][rows])
        maxima = approx_maxima(*part[:5], shape, part[5])
        exact_from_maxima(*part[:5], maxima, part_out, shape, part[5])
    return out

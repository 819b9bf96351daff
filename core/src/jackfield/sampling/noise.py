"""Murmur3 noise: a stateless hash of (request seed, position, token id) turned into Gumbel noise.

Every function takes torch tensors (int64 seed and pos, integer token ids, broadcasting) on any
device and uses only integer ops and IEEE float32 +, -, *, / (no library log/log1p), so the same
inputs give the same bits on the CPU, on any GPU and in the Triton kernel (gumbel_triton.py
mirrors these formulas operation for operation; keep the two in step).
"""

from __future__ import annotations

import math

import torch

MASK32 = 0xFFFFFFFF
DRAFT_POSITION_OFFSET = 1 << 30  # drafting samples from the stream at pos + 2**30
UNIFORM64_HI_DOMAIN = 0x9E3779B9  # hash seed of the high word of murmur3_uniform64

_C1, _C2 = 0xCC9E2D51, 0x1B873593
_MIX_ADD = 0xE6546B64
_FMIX1, _FMIX2 = 0x85EBCA6B, 0xC2B2AE35
_MESSAGE_BYTES = 16

# float32 constants, written as the exact float32 values so no backend rounds them differently.
F32_SQRT2 = 1.41421353816986083984375  # float32(sqrt(2))
F32_LN2_HI = 0.693145751953125  # ln 2 to 16 bits: e * LN2_HI is exact for |e| < 2**8
F32_LN2_LO = 1.428606765330187045037746429443359375e-06  # float32(ln 2 - LN2_HI)
# 2 / (2k + 1): log(m) = 2 atanh(s) = 2s + s^3 (2/3 + s^2 (2/5 + s^2 (2/7 + s^2 2/9)))
F32_ATANH_COEFFS = (
    0.666666686534881591796875,
    0.4000000059604644775390625,
    0.2857142984867095947265625,
    0.2222222238779067993164062,
)
# 1 / k for k = 8 .. 1: the Horner form of v + v^2/2 + ... + v^8/8
F32_INV_K = (
    0.125,
    0.1428571492433547973632812,
    0.1666666716337203979492188,
    0.2000000029802322387695312,
    0.25,
    0.3333333432674407958984375,
    0.5,
    1.0,
)
F32_MIN_ONE_MINUS_V = 2.0**-24
GUMBEL_F32_AT_U1 = -math.log(24 * math.log(2))  # the float32 noise at u = 1


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """a * c mod 2**32 for 0 <= a < 2**32, in int64 without overflow (c split into 16-bit halves)."""
    low = a * (c & 0xFFFF)
    high = ((a * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & MASK32


def scrambled_word(word: torch.Tensor) -> torch.Tensor:
    """k = rotl(word * c1, 15) * c2 (mod 2^32): the scramble of one message word (int64 in, out)."""
    return _mul32(_rotl32(_mul32(word & MASK32, _C1), 15), _C2)


def murmur3_hash32(
    seed: torch.Tensor, pos: torch.Tensor, token: torch.Tensor, domain: int = 0
) -> torch.Tensor:
    """MurmurHash3_x86_32 of the 16-byte little-endian message
    [seed low word, seed high word, pos low word, token] with `domain` as the hash seed.

    Returns the uint32 hash as int64.
    """
    seed = seed.to(torch.int64)
    words = (
        seed & MASK32,
        (seed >> 32) & MASK32,
        pos.to(torch.int64) & MASK32,
        token.to(torch.int64) & MASK32,
    )
    h = torch.tensor(domain & MASK32, dtype=torch.int64, device=seed.device)
    for word in words:
        h = _rotl32(h ^ scrambled_word(word), 13)
        h = (_mul32(h, 5) + _MIX_ADD) & MASK32
    h = h ^ _MESSAGE_BYTES
    h = _mul32(h ^ (h >> 16), _FMIX1)
    h = _mul32(h ^ (h >> 13), _FMIX2)
    return h ^ (h >> 16)


def uniform32_from_hash(r: torch.Tensor) -> torch.Tensor:
    """float32 in (0, 1]: (r >> 16) * 2^-16 + ((r & 0xFFFF) + 0.5) * 2^-32, both terms exact.

    The 32-bit word is never converted to float32 whole (backends round that differently).
    """
    high = (r >> 16).to(torch.float32) * 2.0**-16
    low = ((r & 0xFFFF).to(torch.float32) + 0.5) * 2.0**-32
    return high + low


def murmur3_uniform32(seed: torch.Tensor, pos: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """float32 in (0, 1] from murmur3_hash32 (see uniform32_from_hash)."""
    return uniform32_from_hash(murmur3_hash32(seed, pos, token))


def uniform64_from_hashes(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """float64 in (0, 1): bits = ((hi << 32) | lo) >> 11, u = (bits + 0.5) * 2^-53, never 1.0."""
    bits = (hi << 21) | (lo >> 11)  # ((hi << 32) | lo) >> 11 without leaving 63 bits
    u = (bits.to(torch.float64) + 0.5) * 2.0**-53
    return torch.where(u >= 1.0, torch.full_like(u, 1.0 - 2.0**-53), u)


def murmur3_uniform64(seed: torch.Tensor, pos: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """float64 in (0, 1) from two hashes (domains 0 and 0x9E3779B9)."""
    lo = murmur3_hash32(seed, pos, token, domain=0)
    hi = murmur3_hash32(seed, pos, token, domain=UNIFORM64_HI_DOMAIN)
    return uniform64_from_hashes(lo, hi)


def log_f32(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive normal float32 values from +, -, *, / alone (about 1 ulp).

    x = 2^e * m with m in [sqrt(1/2), sqrt(2)); log(m) = 2 atanh(s), s = (m - 1) / (m + 1).
    """
    bits = x.view(torch.int32).to(torch.int64)
    exponent = ((bits >> 23) & 0xFF) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).to(torch.int32).view(torch.float32)
    big = m > F32_SQRT2
    m = torch.where(big, m * 0.5, m)
    e = torch.where(big, exponent + 1, exponent).to(torch.float32)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    c3, c5, c7, c9 = F32_ATANH_COEFFS
    poly = c3 + z * (c5 + z * (c7 + z * c9))
    log_m = (s + s) + (s * z) * poly
    return e * F32_LN2_HI + (log_m + e * F32_LN2_LO)


def log1p_neg_stable(v: torch.Tensor) -> torch.Tensor:
    """log(1 - v) in float32 for v in [0, 1]: a degree-8 series below 0.25, else log(max(1 - v, 2^-24))."""
    v = v.to(torch.float32)
    series = torch.full_like(v, F32_INV_K[0])
    for inv_k in F32_INV_K[1:]:
        series = inv_k + v * series
    series = -(v * series)
    clamped = torch.clamp(1.0 - v, min=F32_MIN_ONE_MINUS_V)
    return torch.where(v < 0.25, series, log_f32(clamped))


def gumbel_noise(
    seed: torch.Tensor, pos: torch.Tensor, token: torch.Tensor, fp64: bool = False
) -> torch.Tensor:
    """Standard Gumbel noise, finite everywhere.

    float32: -log(-log1p_neg_stable(u)), u = murmur3_uniform32 (u = 1 gives -log(24 ln 2)).
    fp64: -log(-log(u)) with u = murmur3_uniform64 and the library float64 log.
    """
    if fp64:
        u64 = murmur3_uniform64(seed, pos, token)
        return -torch.log(-torch.log(u64))
    return gumbel_from_uniform32(murmur3_uniform32(seed, pos, token))


def gumbel_from_uniform32(u: torch.Tensor) -> torch.Tensor:
    """float32 Gumbel noise -log(-log1p_neg_stable(u)) for u in (0, 1]."""
    return -log_f32(-log1p_neg_stable(u))

"""Murmur3 noise against the published MurmurHash3_x86_32 and float64 references."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jackfield.sampling import (
    DRAFT_POSITION_OFFSET,
    gumbel_noise,
    log1p_neg_stable,
    murmur3_hash32,
    murmur3_uniform32,
    murmur3_uniform64,
)
from jackfield.sampling.noise import (
    GUMBEL_F32_AT_U1,
    UNIFORM64_HI_DOMAIN,
    gumbel_from_uniform32,
    log_f32,
    uniform32_from_hash,
    uniform64_from_hashes,
)


def reference_murmur3_x86_32(data: bytes, seed: int) -> int:
    """MurmurHash3_x86_32 over a byte string, written from the published algorithm (SMHasher)."""

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF

    def scramble(k: int) -> int:
        return (rotl((k * 0xCC9E2D51) & 0xFFFFFFFF, 15) * 0x1B873593) & 0xFFFFFFFF

    h = seed & 0xFFFFFFFF
    whole = len(data) // 4 * 4
    for i in range(0, whole, 4):
        h = rotl(h ^ scramble(int.from_bytes(data[i : i + 4], "little")), 13)
        h = (h * 5 + 0xE6546B64) & 0xFFFFFFFF
    tail = data[whole:]
    if tail:
        h ^= scramble(int.from_bytes(tail, "little"))
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


# Published MurmurHash3_x86_32 vectors (the SMHasher-derived table widely used by ports).
PUBLISHED = [
    (b"", 0, 0),
    (b"", 1, 0x514E28B7),
    (b"", 0xFFFFFFFF, 0x81F16F39),
    (b"\xff\xff\xff\xff", 0, 0x76293B50),
    (b"\x21\x43\x65\x87", 0, 0xF55B516B),
    (b"\x21\x43\x65\x87", 0x5082EDEE, 0x2362F9DE),
    (b"\x21\x43\x65", 0, 0x7E4A8634),
    (b"\x21\x43", 0, 0xA0F7B07A),
    (b"\x21", 0, 0x72661CF4),
    (b"\x00\x00\x00\x00", 0, 0x2362F9DE),
    (b"\x00\x00\x00", 0, 0x85F0B427),
    (b"aaaa", 0x9747B28C, 0x5A97808A),
    (b"aaa", 0x9747B28C, 0x283E0130),
    (b"a", 0x9747B28C, 0x7FA09EA6),
]


@pytest.mark.parametrize(("data", "seed", "expected"), PUBLISHED)
def test_reference_matches_published_vectors(data: bytes, seed: int, expected: int) -> None:
    assert reference_murmur3_x86_32(data, seed) == expected


def _message(seed: int, pos: int, token: int) -> bytes:
    return struct.pack("<IIII", seed & 0xFFFFFFFF, seed >> 32, pos & 0xFFFFFFFF, token)


def test_hash_matches_reference_on_random_messages() -> None:
    g = torch.Generator().manual_seed(1)
    seeds = torch.randint(0, 2**63 - 1, (300,), generator=g)
    pos = torch.randint(0, 2**40, (300,), generator=g)  # only the low 32 bits enter the message
    tokens = torch.randint(0, 2**31 - 1, (300,), generator=g)
    for domain in (0, UNIFORM64_HI_DOMAIN, 0xFFFFFFFF):
        got = murmur3_hash32(seeds, pos, tokens, domain=domain).tolist()
        want = [
            reference_murmur3_x86_32(_message(s, p, t), domain)
            for s, p, t in zip(seeds.tolist(), pos.tolist(), tokens.tolist(), strict=True)
        ]
        assert got == want


def test_hash_broadcasts_and_stays_in_uint32_range() -> None:
    seeds = torch.tensor([[3], [2**62 + 5]])
    tokens = torch.arange(7).unsqueeze(0)
    h = murmur3_hash32(seeds, torch.tensor(11), tokens)
    assert h.shape == (2, 7) and h.dtype == torch.int64
    assert int(h.min()) >= 0 and int(h.max()) < 2**32
    assert h[1, 4] == reference_murmur3_x86_32(_message(2**62 + 5, 11, 4), 0)


def test_uniform32_is_the_exact_two_term_sum() -> None:
    r = torch.randint(0, 2**32, (20000,), dtype=torch.int64, generator=torch.Generator().manual_seed(2))
    exact = (r >> 16).double() * 2.0**-16 + ((r & 0xFFFF).double() + 0.5) * 2.0**-32  # exact in float64
    assert torch.equal(uniform32_from_hash(r), exact.float())  # one rounding, as in float32


def test_uniform_endpoints() -> None:
    ends = torch.tensor([0, 0xFFFFFFFF])
    u32 = uniform32_from_hash(ends)
    assert u32[0].item() == 2.0**-33 and u32[1].item() == 1.0  # (0, 1]: 1 - 2^-33 rounds to 1
    u64 = uniform64_from_hashes(ends, ends)
    assert u64[0].item() == 2.0**-54 and u64[1].item() == 1.0 - 2.0**-53  # (0, 1)


def test_float32_noise_at_the_endpoints_is_finite() -> None:
    at_one = gumbel_from_uniform32(torch.tensor([1.0]))
    assert at_one.item() == pytest.approx(GUMBEL_F32_AT_U1, rel=1e-6)
    assert GUMBEL_F32_AT_U1 == pytest.approx(-math.log(24 * math.log(2)))
    at_zero = gumbel_from_uniform32(torch.tensor([2.0**-33]))
    assert at_zero.item() == pytest.approx(33 * math.log(2), rel=1e-6)  # -log(-log(1 - u)) ~ -log(u)
    assert log1p_neg_stable(torch.tensor([1.0])).item() == pytest.approx(-24 * math.log(2), rel=1e-6)


def test_log_f32_against_float64() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.exp(torch.empty(200000).uniform_(-80, 80, generator=g)).float()
    x = torch.cat([x, torch.tensor([1.0, 2.0, 0.5, 2.0**-24, 2.0**-126, 3.0e38, 1.0 + 2**-23, 1.0 - 2**-24])])
    err = (log_f32(x).double() - x.double().log()).abs()
    ulp = torch.finfo(torch.float32).eps * x.double().log().abs().clamp(min=2.0**-24)
    assert float((err / ulp).max()) < 2.0  # within two float32 ulps everywhere
    assert log_f32(torch.tensor([1.0])).item() == 0.0


def test_log1p_neg_stable_against_float64() -> None:
    v = torch.cat(
        [torch.rand(100000, generator=torch.Generator().manual_seed(4)), torch.tensor([0.0, 0.2499999, 0.25])]
    )
    want = torch.log1p(-v.double())
    err = (log1p_neg_stable(v).double() - want).abs() / want.abs().clamp(min=1e-30)
    assert float(err[v < 0.25].max()) < 2e-6  # the degree-8 series: v^9/9 at v = 0.25
    assert float(err[v >= 0.25].max()) < 5e-7


def test_gumbel_f32_against_float64_of_the_same_uniform() -> None:
    seeds = torch.arange(64).unsqueeze(1) * 7919 + 2**40
    tokens = torch.arange(2048).unsqueeze(0)
    u = murmur3_uniform32(seeds, torch.tensor(5), tokens).double()
    want = -torch.log(-torch.log1p(-u.clamp(max=1 - 2.0**-24)))
    got = gumbel_noise(seeds, torch.tensor(5), tokens)
    assert got.dtype == torch.float32
    assert float((got.double() - want).abs().max()) < 1e-5


def test_gumbel_fp64_against_python_math() -> None:
    seeds, pos, tokens = torch.tensor([9, 2**50]), torch.tensor([1, 2**31 + 3]), torch.tensor([0, 4095])
    got = gumbel_noise(seeds, pos, tokens, fp64=True)
    u = murmur3_uniform64(seeds, pos, tokens).tolist()
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx([-math.log(-math.log(x)) for x in u], rel=1e-14)


def test_gumbel_moments() -> None:
    g = gumbel_noise(
        torch.tensor(123), torch.arange(400).unsqueeze(1), torch.arange(1000).unsqueeze(0)
    ).double()
    n = g.numel()
    assert abs(g.mean().item() - 0.5772156649) < 5 * (math.pi / math.sqrt(6)) / math.sqrt(n)
    assert g.var().item() == pytest.approx(math.pi**2 / 6, rel=0.02)


def test_drafting_stream_is_disjoint_from_the_target_stream() -> None:
    tokens = torch.arange(256)
    target = murmur3_hash32(torch.tensor(42), torch.tensor(10), tokens)
    draft = murmur3_hash32(torch.tensor(42), torch.tensor(10 + DRAFT_POSITION_OFFSET), tokens)
    assert (target != draft).all()


U32 = st.integers(0, 2**32 - 1)


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), pos=st.integers(0, 2**62), token=st.integers(0, 2**31 - 1))
def test_uniform_ranges_property(seed: int, pos: int, token: int) -> None:
    s, p, t = torch.tensor([seed]), torch.tensor([pos]), torch.tensor([token])
    u32 = murmur3_uniform32(s, p, t).item()
    u64 = murmur3_uniform64(s, p, t).item()
    assert 0.0 < u32 <= 1.0 and 0.0 < u64 < 1.0
    assert math.isfinite(gumbel_noise(s, p, t).item()) and math.isfinite(
        gumbel_noise(s, p, t, fp64=True).item()
    )
    assert murmur3_hash32(s, p, t).item() == reference_murmur3_x86_32(_message(seed, pos, token), 0)


@settings(max_examples=300, deadline=None)
@given(lo=U32, hi=U32)
def test_uniform_transforms_property(lo: int, hi: int) -> None:
    u32 = uniform32_from_hash(torch.tensor([lo])).item()
    assert 0.0 < u32 <= 1.0
    assert u32 == float(np.float32((lo >> 16) * 2.0**-16 + ((lo & 0xFFFF) + 0.5) * 2.0**-32))
    u64 = uniform64_from_hashes(torch.tensor([lo]), torch.tensor([hi])).item()
    assert 0.0 < u64 < 1.0
    assert u64 == min((((hi << 32) | lo) >> 11) * 2.0**-53 + 2.0**-54, 1 - 2.0**-53)
    assert math.isfinite(gumbel_from_uniform32(torch.tensor([u32])).item())


@pytest.mark.gpu
def test_noise_bits_identical_on_cpu_and_cuda() -> None:
    seeds = torch.randint(0, 2**63 - 1, (64, 1))
    pos = torch.randint(0, 2**31, (64, 1))
    tokens = torch.arange(50000).unsqueeze(0)
    cpu = gumbel_noise(seeds, pos, tokens)
    cuda = gumbel_noise(seeds.cuda(), pos.cuda(), tokens.cuda()).cpu()
    assert torch.equal(cpu.view(torch.int32), cuda.view(torch.int32))

"""The Triton paths against PyTorch: the approximate/exact split of the Gumbel kernels, the
Triton filter kernel's statuses and cutoffs, and the deterministic top-p definition."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from jackfield.sampling import filters_triton, gumbel_triton
from jackfield.sampling.filters import exp_f32, filter_cutoffs, top_p_weights
from jackfield.sampling.noise import gumbel_from_uniform32, murmur3_hash32, uniform32_from_hash
from jackfield.sampling.sample import sample_with_scores

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_triton_here = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1", reason="Triton needs CUDA or TRITON_INTERPRET=1"
)


def batch(rows: int, vocab: int, seed: int, scale: float = 3.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "logits": (torch.randn(rows, vocab, generator=g) * scale).to(DEVICE),
        "temperature": (torch.rand(rows, generator=g) * 1.5 + 0.2).to(DEVICE),
        "seeds": torch.randint(0, 2**63 - 1, (rows,), generator=g).to(DEVICE),
        "positions": torch.randint(0, 2**31, (rows,), generator=g).to(DEVICE),
    }


def assert_same(
    b: dict, block: int | None = None, **filters: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    want = sample_with_scores(**b, **filters, impl="torch")
    got = sample_with_scores(**b, **filters, impl="triton", block=block)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))  # bit for bit
    return want


@triton.jit
def _approx_noise_kernel(r_ptr, out_ptr, n, BLOCK: tl.constexpr, FAST_LOG: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    r = tl.load(r_ptr + i, mask=i < n, other=0).to(tl.uint32)
    tl.store(
        out_ptr + i, gumbel_triton.approx_noise(gumbel_triton._uniform_from_hash(r), FAST_LOG), mask=i < n
    )


@needs_triton_here
def test_approximate_noise_is_within_the_bound_of_the_exact_noise() -> None:
    """Random hashes plus the edges (u near 0, near 1/16, 1/4, 1/2 and 1): |noise~ - noise| < 2e-5,
    the figure E(M) is derived from (stage 1 runs with FMA fusion, as here)."""
    g = torch.Generator().manual_seed(12)
    edges = [0, 1, 2, 0xFFFF, 0x10000, 2**28 - 1, 2**28, 2**28 + 1, 2**30, 2**31, 2**32 - 2, 2**32 - 1]
    r = torch.cat([torch.randint(0, 2**32, (1 << 15,), generator=g), torch.tensor(edges)])
    exact = gumbel_from_uniform32(uniform32_from_hash(r))
    out = torch.full(r.shape, float("nan"), device=DEVICE)
    _approx_noise_kernel[(triton.cdiv(r.numel(), 1024),)](
        r.to(DEVICE), out, r.numel(), BLOCK=1024, FAST_LOG=CUDA
    )
    err = (out.cpu().double() - exact.double()).abs()
    assert float(err.max()) < 2e-5
    assert float(err.max()) > 0  # the approximation really is one (a test that can fail)


def tie_batch(vocab: int, a: int, b: int, ulps: int) -> dict:
    """Two tokens a < b in different chunks whose EXACT scores are equal (ulps = 0) or b's is
    `ulps` float32 steps higher; every other token is 30 below. Closer than any E, so only the
    exact recompute can order them."""
    seeds, positions = torch.tensor([77]), torch.tensor([5])
    tokens = torch.arange(vocab)
    noise = gumbel_from_uniform32(uniform32_from_hash(murmur3_hash32(seeds, positions, tokens)))
    logits = torch.full((1, vocab), -30.0) - noise  # scores of the crowd: about -30
    target = torch.tensor(10.0)
    logits[0, a] = target - noise[a]
    score_a = logits[0, a] + noise[a]
    x_b = target - noise[b]
    for _ in range(200):  # walk x_b until its exact score is score_a moved by `ulps` steps
        score_b = x_b + noise[b]
        want = score_a
        for _ in range(ulps):
            want = torch.nextafter(want, torch.tensor(math.inf))
        if score_b == want:
            break
        x_b = torch.nextafter(x_b, torch.tensor(math.inf if score_b < want else -math.inf))
    assert score_b == want
    logits[0, b] = x_b
    return {"logits": logits.to(DEVICE), "temperature": torch.ones(1, device=DEVICE),
            "seeds": seeds.to(DEVICE), "positions": positions.to(DEVICE)}  # fmt: skip


@needs_triton_here
@pytest.mark.parametrize(("ulps", "winner"), [(0, 10), (1, 3000), (3, 3000)])
@pytest.mark.parametrize("block", [64, 1024])
def test_scores_closer_than_the_bound_in_different_chunks(ulps: int, winner: int, block: int) -> None:
    b = tie_batch(4097, 10, 3000, ulps)
    tokens, _ = assert_same(b, block=block)
    assert tokens.item() == winner  # a tie goes to the lower index, one ulp more wins


@needs_triton_here
@pytest.mark.parametrize(("vocab", "block"), [(1, 64), (999, 256), (1024, 1024), (4097, 128), (4097, 1024)])
def test_temperatures_cutoffs_and_non_finite_rows(vocab: int, block: int) -> None:
    b = batch(8, vocab, seed=vocab + block)
    b["temperature"][0] = 0.0
    b["temperature"][1] = 1e-30  # x / T past 2^64: the approximation is not trusted, whole row exact
    b["logits"][2, : vocab // 2 + 1] = float("nan")
    b["logits"][3] = float("-inf")
    b["logits"][4, vocab // 3] = float("inf")  # never sampled; stage 1 then recomputes the row
    b["logits"][5, ::2] = 1.5  # ties
    assert_same(b, block=block)
    min_p = torch.tensor([0.0, 0.0, 0.3, 0.1, 0.05, 0.2, 0.0, 0.9], device=DEVICE)
    assert_same(b, block=block, min_p=min_p)


@needs_triton_here
def test_filter_combinations_and_statuses() -> None:
    vocab = 20000
    b = batch(10, vocab, seed=3)
    b["temperature"][1] = 0.0
    b["logits"][7] = 2.0  # every logit tied: more than CAP candidates
    b["logits"][8, :5000] = float("-inf")
    top_k = torch.tensor([50, 50, 1, 256, 0, 300, 0, 5, 20, 7], device=DEVICE)
    top_p = torch.tensor([0.9, 0.9, 1.0, 0.5, 1.0, 0.8, 0.7, 0.9, 0.0, 1.0], device=DEVICE)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.01, 0.1, 0.0, 0.0, 0.0, 0.0, 0.3], device=DEVICE)
    token, score, cutoff, status, flags = filters_triton.filter_and_sample_triton(
        **b, top_k=top_k, top_p=top_p, min_p=min_p
    )
    done, sampling, torch_cutoff = (
        filters_triton.DONE,
        filters_triton.NEEDS_SAMPLING,
        filters_triton.NEEDS_TORCH_CUTOFF,
    )
    assert status.tolist() == [
        done,
        sampling,
        done,
        done,
        sampling,
        torch_cutoff,
        torch_cutoff,
        torch_cutoff,
        done,
        done,
    ]
    assert flags.item() == 0b111
    want_cutoff = filter_cutoffs(b["logits"], b["temperature"], top_k, top_p, min_p)
    own = status != torch_cutoff
    assert torch.equal(cutoff[own].view(torch.int32), want_cutoff[own].view(torch.int32))
    want = sample_with_scores(**b, top_k=top_k, top_p=top_p, min_p=min_p, impl="torch")
    is_done = status == done
    assert torch.equal(token[is_done], want[0][is_done])
    assert torch.equal(score[is_done].view(torch.int32), want[1][is_done].view(torch.int32))
    assert_same(b, top_k=top_k, top_p=top_p, min_p=min_p)


@needs_triton_here
@pytest.mark.parametrize("vocab", [999, 4097])
def test_top_k_top_p_sweep(vocab: int) -> None:
    b = batch(6, vocab, seed=vocab, scale=2.0)
    b["logits"][3, ::3] = b["logits"][3, 0]  # many ties, some at the k-th value
    g = torch.Generator().manual_seed(vocab)
    top_k = torch.randint(1, 80, (6,), generator=g).to(DEVICE)
    top_p = (torch.rand(6, generator=g) * 0.9 + 0.05).to(DEVICE)
    min_p = torch.tensor([0.1, 0.0, 0.0, 0.0, 0.1, 0.0]).to(DEVICE)
    top_p[1] = 1.0  # top-k alone
    assert_same(b, top_k=top_k, top_p=top_p, min_p=min_p)


def test_exp_f32_against_float64() -> None:
    d = torch.cat(
        [-torch.rand(100000, generator=torch.Generator().manual_seed(1)) * 32, torch.tensor([0.0, -32.0])]
    )
    got = exp_f32(d).double()
    want = torch.exp(d.double())
    assert float(((got - want).abs() / want).max()) < 4 * 2.0**-24


def test_top_p_weights_follow_the_float64_softmax() -> None:
    g = torch.Generator().manual_seed(2)
    values = torch.sort(torch.randn(3, 200, generator=g) * 4, descending=True).values
    values[2, 150:] = float("-inf")
    t = torch.tensor([0.7, 1.0, 2.0])
    w = top_p_weights(values, values[:, 0], t)
    assert w.dtype == torch.int64 and int(w[2, 150:].abs().sum()) == 0
    probs = torch.softmax(values.double() / t.double().unsqueeze(1), dim=1)
    ratio = w.double() / w.double().sum(dim=1, keepdim=True)
    assert float((ratio - probs).abs().max()) < 1e-6


def test_top_p_cutoff_against_an_independent_float64_reference() -> None:
    """The integer top-p boundary equals float64 softmax + cumsum wherever the float64 mass is
    not within 1e-6 of top_p."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, 300, generator=g) * 2
    t = torch.rand(64, generator=g) + 0.5
    p = torch.rand(64, generator=g) * 0.9 + 0.05
    got = filter_cutoffs(x, t, None, p, None)
    sorted_x = torch.sort(x.double(), dim=1, descending=True).values
    probs = torch.softmax(sorted_x / t.double().unsqueeze(1), dim=1)
    before = torch.cumsum(probs, dim=1) - probs
    last = (before < p.double().unsqueeze(1)).sum(dim=1) - 1
    want = sorted_x.gather(1, last.unsqueeze(1)).squeeze(1).float()
    near = ((before - p.double().unsqueeze(1)).abs() < 1e-6).any(dim=1)
    assert int(near.sum()) < 3
    assert torch.equal(got[~near], want[~near])


def test_kernel_constants_are_the_float32_roundings_they_claim() -> None:
    assert gumbel_triton._S1.value == float(np.float32(1 / math.log(2)))
    assert gumbel_triton._S4.value == float(np.float32(1 / (4 * math.log(2))))
    assert gumbel_triton._NEG_LN_LN2.value == float(np.float32(-math.log(math.log(2))))
    assert gumbel_triton._LN2.value == float(np.float32(math.log(2)))

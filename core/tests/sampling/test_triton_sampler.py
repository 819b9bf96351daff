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
from jackfield.sampling.gumbel_torch import gumbel_argmax_torch
from jackfield.sampling.gumbel_triton import LaunchShape, gumbel_argmax_triton, token_table
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
    """Random hashes plus the edges (u near 0, near 1/32, 1/4, 1/2 and 1): |noise~ - noise| < 3e-5,
    the figure E(M) is derived from (stage 1 runs with FMA fusion, as here)."""
    g = torch.Generator().manual_seed(12)
    edges = [0, 1, 2, 0xFFFF, 0x10000, 2**27 - 1, 2**27, 2**27 + 1, 2**30, 2**31, 2**32 - 2, 2**32 - 1]
    r = torch.cat([torch.randint(0, 2**32, (1 << 15,), generator=g), torch.tensor(edges)])
    exact = gumbel_from_uniform32(uniform32_from_hash(r))
    out = torch.full(r.shape, float("nan"), device=DEVICE)
    _approx_noise_kernel[(triton.cdiv(r.numel(), 1024),)](
        r.to(DEVICE), out, r.numel(), BLOCK=1024, FAST_LOG=CUDA
    )
    err = (out.cpu().double() - exact.double()).abs()
    assert float(err.max()) < 3e-5
    assert float(err.max()) > 0  # the approximation really is one (a test that can fail)


M32 = 0xFFFFFFFF


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & M32


def _scramble(k: int) -> int:  # the published MurmurHash3_x86_32 word scramble
    return (_rotl((k * 0xCC9E2D51) & M32, 15) * 0x1B873593) & M32


def _fmix_last(h: int) -> int:
    """Murmur3 from the state after the last word: length 16, then fmix32."""
    h ^= 16
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def test_token_table_is_the_token_half_of_the_hash(rng_seed: int) -> None:
    """Entry t is rotl(scramble(t), 13); with the row half rotl(h3, 13) (h3: the state after the
    seed and position words) XOR then *5 + c and fmix give murmur3_hash32 for fresh messages."""
    g = torch.Generator().manual_seed(rng_seed)
    table = token_table(70_000, torch.device("cpu"))
    tokens = torch.cat([torch.randint(0, 70_000, (200,), generator=g), torch.tensor([0, 1, 69_999])])
    seeds = torch.randint(0, 2**63 - 1, tokens.shape, generator=g)
    pos = torch.randint(0, 2**31, tokens.shape, generator=g)
    want = murmur3_hash32(seeds, pos, tokens).tolist()
    for seed, p, t, hashed in zip(seeds.tolist(), pos.tolist(), tokens.tolist(), want, strict=True):
        entry = table[t].item() & M32
        assert entry == _rotl(_scramble(t), 13)
        h = 0
        for word in (seed & M32, seed >> 32, p & M32):
            h = (_rotl(h ^ _scramble(word), 13) * 5 + 0xE6546B64) & M32
        assert _fmix_last(((_rotl(h, 13) ^ entry) * 5 + 0xE6546B64) & M32) == hashed


def test_token_table_is_cached_once_per_device_and_grows_to_the_longest_vocab() -> None:
    cpu = torch.device("cpu")
    first = token_table(1000, cpu)
    assert token_table(10, cpu) is first  # a longer table serves a shorter vocabulary
    longer = token_table(first.numel() + 1, cpu)
    assert longer.numel() > first.numel() and token_table(1000, cpu) is longer
    assert torch.equal(longer[: first.numel()], first)
    assert list(gumbel_triton._TOKEN_TABLES) == [cpu]


@pytest.mark.parametrize(
    "kwargs", [{"sub_block": 96}, {"step": 0}, {"rows_per_program": 3}, {"sub_block": 64, "step": 128}]
)
def test_launch_shape_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="LaunchShape"):
        LaunchShape(**kwargs)


def winner_in_every_sub_block(vocab: int, sub: int, seed: int) -> tuple[dict, list[int]]:
    """One row per sub-block (the last one partial) whose winner is a random token of that
    sub-block, plus a greedy row and a row with every logit -inf; returns the batch and winners."""
    g = torch.Generator().manual_seed(seed)
    num_sub = (vocab + sub - 1) // sub
    rows = num_sub + 2
    logits = torch.randn(rows, vocab, generator=g)
    winners = []
    for b in range(num_sub):
        token = b * sub + int(torch.randint(0, min(sub, vocab - b * sub), (1,), generator=g))
        logits[b, token] = 60.0  # 60 / T with T <= 1.5 beats every other score (< 4 / 0.7 + 23)
        winners.append(token)
    greedy = num_sub
    winners.append(int(logits[greedy].argmax()))
    logits[greedy + 1] = float("-inf")
    winners.append(0)
    temperature = torch.rand(rows, generator=g) * 0.8 + 0.7
    temperature[greedy] = 0.0
    b = {
        "logits": logits, "temperature": temperature,
        "seeds": torch.randint(0, 2**63 - 1, (rows,), generator=g),
        "positions": torch.randint(0, 2**31, (rows,), generator=g),
    }  # fmt: skip
    return {k: v.to(DEVICE) for k, v in b.items()}, winners


@needs_triton_here
@pytest.mark.parametrize(
    "shape",
    [
        LaunchShape(sub_block=64, step=32, rows_per_program=4),  # rows not a multiple of 4
        LaunchShape(sub_block=128, step=64, rows_per_program=2, sub_blocks_per_program=2),
        LaunchShape(sub_block=64, step=64, rows_per_program=1, sub_blocks_per_program=4),
    ],
)
def test_launch_shapes_find_the_winner_in_any_sub_block(shape: LaunchShape, rng_seed: int) -> None:
    """The winner sits in each sub-block in turn (first, inner, the partial last one); row groups
    mix sampled, greedy and all -inf rows: Triton == torch bit for bit, for every shape."""
    seed = rng_seed
    b, winners = winner_in_every_sub_block(vocab=64 * 6 + 13, sub=shape.sub_block, seed=seed)
    maxima = gumbel_triton.approx_maxima(**b, cutoff=None, shape=shape).cpu().double()
    exact = gumbel_argmax_torch_scores(**{k: v.cpu() for k, v in b.items()})
    vocab = exact.shape[1]
    pad = torch.full((exact.shape[0], maxima.shape[1] * shape.sub_block - vocab), -math.inf)
    want_max = torch.cat([exact, pad], dim=1).view(exact.shape[0], -1, shape.sub_block).amax(dim=2).double()
    finite = torch.isfinite(want_max)
    assert torch.equal(finite, torch.isfinite(maxima)), seed
    # The greedy row: 2^64 x - log2(t) with |log2 t| < 34, then one rounding.
    greedy_error = (maxima[-2] - 2.0**64 * want_max[-2]).abs()
    assert bool((greedy_error <= 34 + 2.0**-24 * maxima[-2].abs()).all()), seed
    sampled = finite.clone()
    sampled[-2] = False
    bound = 3e-5 + 2.0**-20 * (want_max[sampled].abs() + 24)  # e(s) of _approx_error_bound
    assert bool(((maxima[sampled] - want_max[sampled]).abs() <= bound).all()), seed
    out = (
        torch.full((len(winners),), -7, device=DEVICE),
        torch.full((len(winners),), math.nan, device=DEVICE),
    )
    token, score = gumbel_argmax_triton(**b, cutoff=None, shape=shape, out=out)
    want = gumbel_argmax_torch(**b, cutoff=None)
    assert token.tolist() == winners, seed
    assert torch.equal(token, want[0]), seed
    assert torch.equal(score.view(torch.int32), want[1].view(torch.int32)), seed


def gumbel_argmax_torch_scores(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Every token's exact score as gumbel_torch.py defines it (-inf where not finite)."""
    tokens = torch.arange(logits.shape[1])
    noise = gumbel_from_uniform32(
        uniform32_from_hash(murmur3_hash32(seeds[:, None], positions[:, None], tokens))
    )
    greedy = (temperature == 0)[:, None]
    score = torch.where(greedy, logits, logits / torch.where(greedy, 1.0, temperature[:, None]) + noise)
    return torch.where(torch.isfinite(logits), score, -math.inf)


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
def test_scores_closer_than_the_bound_in_different_sub_blocks(ulps: int, winner: int, block: int) -> None:
    b = tie_batch(4097, 10, 3000, ulps)
    tokens, _ = assert_same(b, block=block)
    assert tokens.item() == winner  # a tie goes to the lower index, one ulp more wins


@needs_triton_here
@pytest.mark.parametrize(("a", "b"), [(10, 11), (10, 266), (300, 1000)])
@pytest.mark.parametrize("ulps", [0, 1])
def test_close_scores_inside_one_sub_block(a: int, b: int, ulps: int) -> None:
    """Two exact scores closer than the bound inside one 1024-token sub-block, a few tokens or a
    whole step (256) apart: stage 2 must order them by their exact scores, ties to the lower."""
    tokens, _ = assert_same(tie_batch(4097, a, b, ulps), block=1024)
    assert tokens.item() == (b if ulps else a)


@needs_triton_here
@pytest.mark.parametrize(("a", "b"), [(63, 64), (0, 4096)])
def test_ties_across_a_sub_block_boundary_go_to_the_lower_index(a: int, b: int) -> None:
    """Equal exact scores on both sides of a sub-block edge (and first vs the partial last
    sub-block): both sub-blocks are recomputed and the lower index wins."""
    tokens, _ = assert_same(tie_batch(4097, a, b, 0), block=64)
    assert tokens.item() == a


def greedy_row(vocab: int, seed: int, scale: float) -> torch.Tensor:
    """Logits of one greedy row at magnitude `scale`, fresh random values."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, vocab, generator=g) * scale


@needs_triton_here
@pytest.mark.parametrize("scale", [1e-25, 1e-19, 3.0, 1e17, 1e20])
def test_greedy_rows_near_ties_tiny_and_huge_logits(scale: float, rng_seed: int) -> None:
    """Greedy rows go through stage 1 as 2^64 x - log2(t): the noise outweighs logits below
    ~2^-59 (scale 1e-19 and 1e-25), logits past 2^62 overflow the bound's range (1e20), and
    logits one ulp apart in different sub-blocks are only ordered by stage 2. Rows: random; the
    maximum repeated in a later sub-block (a tie: the lower index wins); the maximum one ulp
    higher in a later sub-block (it wins); all equal."""
    seed = rng_seed
    vocab = 64 * 5 + 7
    logits = greedy_row(vocab, seed, scale).repeat(4, 1)
    first = int(logits[0].abs().argmax())
    logits[:, first] = logits[0].abs().max()
    top = logits[1, first].clone()
    later = (first + 64 * 2 + 5) % vocab
    logits[1, later] = top
    logits[2, later] = torch.nextafter(top, torch.tensor(math.inf))
    logits[3] = top
    b = {
        "logits": logits.to(DEVICE),
        "temperature": torch.zeros(4, device=DEVICE),
        "seeds": torch.randint(0, 2**62, (4,)).to(DEVICE),
        "positions": torch.randint(0, 2**30, (4,)).to(DEVICE),
    }
    tokens, scores = assert_same(b, block=64)
    assert tokens.tolist() == [first, min(first, later), later, 0], seed
    assert scores.cpu()[0].item() == top.item(), seed


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
    b["temperature"][6] = 0.0
    b["logits"][6, vocab // 2] = float("inf")  # greedy: never sampled either, the row is recomputed
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
    assert gumbel_triton._S3.value == float(np.float32(1 / (3 * math.log(2))))
    assert gumbel_triton._NEG_LN_LN2.value == float(np.float32(-math.log(math.log(2))))
    assert gumbel_triton._LN2.value == float(np.float32(math.log(2)))


def test_batches_past_the_grid_limit_run_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 1's rows sit on the grid's y axis (CUDA: at most 65535 programs); with the limit
    lowered to 1 program, 7 rows take 4 launches and give the one-launch result."""
    import jackfield.sampling.gumbel_triton as gt

    g = torch.Generator().manual_seed(31)
    logits = torch.randn(7, 500, generator=g) * 3
    temperature = torch.rand(7, generator=g) + 0.2
    temperature[2] = 0.0
    seeds, positions = torch.randint(0, 2**62, (7,), generator=g), torch.randint(0, 2**30, (7,), generator=g)
    whole = gt.gumbel_argmax_triton(logits, temperature, seeds, positions, None)
    monkeypatch.setattr(gt, "MAX_GRID_Y", 1)
    sliced = gt.gumbel_argmax_triton(logits, temperature, seeds, positions, None)
    assert torch.equal(whole[0], sliced[0]) and torch.equal(whole[1], sliced[1])


@pytest.mark.parametrize("major, overlaps", [(7, False), (8, False), (9, True), (10, True)])
def test_stage_overlap_only_from_compute_capability_9(monkeypatch, major: int, overlaps: bool) -> None:
    """griddepcontrol is an sm_90 instruction: below it (A100, L4, RTX 30/40) ptxas rejects the
    kernels, so stage 2 must launch plainly there."""
    from jackfield.sampling import gumbel_triton

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (major, 0))
    assert gumbel_triton._has_grid_dependency_control.__wrapped__(torch.device("cuda", 0)) is overlaps

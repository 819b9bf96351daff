"""The reference ops against PyTorch's own float64 scaled_dot_product_attention, a sink formula and
softmax over hand-picked keys; paged caches are filled slot by slot here."""

import pytest
import torch
import torch.nn.functional as F
from jackfield.ops import dense_attention, paged_attention, varlen_attention, visibility_mask
from jackfield.ops.reference import topk_visibility


def _sdpa64(q, k, v, scale, mask):
    """q [tq,H,D], k/v [tk,H,D] (already GQA-expanded), mask [tq,tk] bool -> [tq,H,D] float64."""
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1),
        k.double().transpose(0, 1),
        v.double().transpose(0, 1),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1)


def _loop_mask(q_len: int, k_len: int, causal: bool, window: int | None) -> torch.Tensor:
    mask = torch.zeros(q_len, k_len, dtype=torch.bool)
    for i in range(q_len):
        p = k_len - q_len + i
        for j in range(k_len):
            mask[i, j] = (not causal or j <= p) and (window is None or p - j < window)
    return mask


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 3])
def test_varlen_matches_sdpa_with_gqa(causal: bool, window: int | None) -> None:
    g = torch.Generator().manual_seed(11)
    h, hkv, d, dv = 4, 2, 16, 8
    q_lens, k_lens = [3, 1, 5], [7, 1, 5]
    cu_q, cu_k = [0, 3, 4, 9], [0, 7, 8, 13]
    q, k, v = (
        torch.randn(9, h, d, generator=g),
        torch.randn(13, hkv, d, generator=g),
        torch.randn(13, hkv, dv, generator=g),
    )
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, 0.3, causal=causal, sliding_window=window)
    assert out.dtype == torch.float32 and lse.shape == (9, h)
    for b in range(3):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        mask = _loop_mask(q_lens[b], k_lens[b], causal, window)
        kx, vx = k[ks].repeat_interleave(2, dim=1), v[ks].repeat_interleave(2, dim=1)
        torch.testing.assert_close(out[qs].double(), _sdpa64(q[qs], kx, vx, 0.3, mask), atol=1e-5, rtol=1e-5)
        s = torch.einsum("qhd,khd->qhk", q[qs].double(), kx.double()) * 0.3
        want_lse = torch.logsumexp(s.masked_fill(~mask[:, None, :], float("-inf")), dim=-1)
        torch.testing.assert_close(lse[qs].double(), want_lse, atol=1e-5, rtol=1e-5)


def test_sinks_join_the_denominator_only() -> None:
    g = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(4, 2, 8, generator=g),
        torch.randn(6, 2, 8, generator=g),
        torch.randn(6, 2, 8, generator=g),
    )
    sinks = torch.randn(2, generator=g)
    visible = visibility_mask(4, 6, causal=True)
    out, lse = dense_attention(q, k, v, 0.5, visible, sinks)
    # gpt-oss formulation: append the sink as an extra logit column, softmax, drop that column
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * 0.5
    s = s.masked_fill(~visible[None], float("-inf"))
    s = torch.cat([s, sinks.double()[:, None, None].expand(-1, 4, 1)], dim=-1)
    probs = torch.softmax(s, dim=-1)[..., :-1]
    torch.testing.assert_close(
        out.double(), torch.einsum("hqk,khd->qhd", probs, v.double()), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, dim=-1).T, atol=1e-5, rtol=1e-5)


def test_causal_rows_before_the_first_key_see_none() -> None:
    assert visibility_mask(4, 2, causal=True).tolist() == [[False, False]] * 2 + [[True, False], [True, True]]


def test_rows_without_keys_are_zero_with_minus_inf_lse() -> None:
    visible = torch.tensor([[True, False], [False, False]])
    out, lse = dense_attention(
        torch.randn(2, 1, 4), torch.randn(2, 1, 4), torch.randn(2, 1, 4), 1.0, visible, torch.zeros(1)
    )
    assert torch.equal(out[1], torch.zeros(1, 4)) and lse[1].item() == float("-inf")
    assert torch.isfinite(out).all() and torch.isfinite(lse[0]).all()


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        visibility_mask(2, 3, causal=True, sliding_window=0)
    with pytest.raises(ValueError, match="not a multiple of kv heads"):
        dense_attention(
            torch.randn(1, 3, 4),
            torch.randn(2, 2, 4),
            torch.randn(2, 2, 4),
            1.0,
            torch.ones(1, 2, dtype=torch.bool),
        )
    q, k = torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    with pytest.raises(ValueError, match="entries"):
        varlen_attention(q, k, k, [0, 3], [0, 1, 3], 1.0)
    with pytest.raises(ValueError, match="cu_seqlens end"):
        varlen_attention(q, k, k, [0, 2], [0, 3], 1.0)


def _paged(keys: list[torch.Tensor], values: list[torch.Tensor], block_size: int, g: torch.Generator):
    """Caches holding each request's keys/values, written slot by slot at shuffled blocks."""
    widths = [-(-k.shape[0] // block_size) for k in keys]
    num_blocks = sum(widths) + 1
    order = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(keys), max(widths)), order[-1], dtype=torch.int32)
    key_cache = torch.full((num_blocks, block_size, *keys[0].shape[1:]), float("nan"), dtype=keys[0].dtype)
    value_cache = torch.full(
        (num_blocks, block_size, *values[0].shape[1:]), float("nan"), dtype=keys[0].dtype
    )
    taken = 0
    for b, (k, v) in enumerate(zip(keys, values, strict=True)):
        for i in range(widths[b]):
            table[b, i] = order[taken]
            taken += 1
        for p in range(k.shape[0]):
            block = int(table[b, p // block_size])
            key_cache[block, p % block_size], value_cache[block, p % block_size] = k[p], v[p]
    return key_cache, value_cache, table


@pytest.mark.parametrize("causal", [True, False])
def test_paged_attention_matches_sdpa_per_request_in_float64(causal: bool, rng_seed: int) -> None:
    """A decode, a prefill, a chunk, more queries than keys (causal: the first row sees none) and
    a request without keys (a padded row): 0 and -inf wherever a row sees nothing."""
    g = torch.Generator().manual_seed(rng_seed)
    h, hkv, d, dv, block_size = 4, 2, 8, 6, 3
    q_lens, seq_lens = [1, 4, 2, 3, 1], [7, 4, 9, 2, 0]
    keys = [torch.randn(s, hkv, d, generator=g, dtype=torch.float64) for s in seq_lens]
    values = [torch.randn(s, hkv, dv, generator=g, dtype=torch.float64) for s in seq_lens]
    key_cache, value_cache, table = _paged(keys, values, block_size, g)
    q = torch.randn(sum(q_lens), h, d, generator=g, dtype=torch.float64)
    qsl = torch.tensor([0, *q_lens]).cumsum(0)
    out, lse = paged_attention(
        q, key_cache, value_cache, table, torch.tensor(seq_lens), qsl, 0.3, causal=causal
    )
    assert out.dtype == lse.dtype == torch.float64
    for b in range(len(q_lens)):
        mask = _loop_mask(q_lens[b], seq_lens[b], causal, None)
        kx, vx = keys[b].repeat_interleave(2, dim=1), values[b].repeat_interleave(2, dim=1)
        for i in range(q_lens[b]):
            row = int(qsl[b]) + i
            if not mask[i].any():
                assert torch.equal(out[row], torch.zeros(h, dv)) and bool((lse[row] == float("-inf")).all())
                continue
            want = _sdpa64(q[row : row + 1], kx, vx, 0.3, mask[i : i + 1])[0]
            torch.testing.assert_close(out[row], want, atol=1e-12, rtol=1e-12)


def test_paged_attention_of_an_mla_cache_topk_and_fp8_scale(rng_seed: int) -> None:
    """The latent records as keys, their first L entries as values; top-k rows attend exactly the
    listed positions (a row listing none: 0 and -inf); an fp8 cache is multiplied by its scale."""
    g = torch.Generator().manual_seed(rng_seed)
    h, latent, rope, block_size = 3, 8, 4, 4
    seq_lens, chosen = [6, 9], [[0, 5, 2], [8, -1, -1], [-1, -1, -1]]  # q_lens 1 and 2
    records = [torch.randn(s, latent + rope, generator=g) for s in seq_lens]
    fp8 = [(r / 0.05).to(torch.float8_e4m3fn) for r in records]
    cache, _, table = _paged([r[:, None] for r in fp8], [r[:, None] for r in fp8], block_size, g)
    cache = cache[:, :, 0]
    q = torch.randn(3, h, latent + rope, generator=g, dtype=torch.float64)
    lens, qsl, topk = torch.tensor(seq_lens), torch.tensor([0, 1, 3]), torch.tensor(chosen)
    keys, values = cache[:, :, None], cache[:, :, None, :latent]
    out, lse = paged_attention(q, keys, values, table, lens, qsl, 0.5, topk_indices=topk, kv_scale=0.05)
    for row, (b, listed) in enumerate(zip([0, 1, 1], chosen, strict=True)):
        keys = fp8[b].double()[[p for p in listed if p >= 0]] * 0.05
        if keys.numel() == 0:
            assert torch.equal(out[row], torch.zeros(h, latent)) and bool((lse[row] == float("-inf")).all())
            continue
        s = q[row].double() @ keys.T * 0.5  # [H, keys]
        torch.testing.assert_close(out[row], torch.softmax(s, -1) @ keys[:, :latent], atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(lse[row], torch.logsumexp(s, -1), atol=1e-12, rtol=1e-12)


def test_inputs_below_float64_compute_in_float32() -> None:
    visible = visibility_mask(2, 3, causal=True)
    for dtype, want in (
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ):
        out, lse = dense_attention(
            torch.randn(2, 1, 4, dtype=dtype), torch.randn(3, 1, 4), torch.randn(3, 1, 4), 1.0, visible
        )
        assert out.dtype == lse.dtype == want


def test_topk_positions_outside_the_request_are_rejected() -> None:
    with pytest.raises(ValueError, match="topk indices must be in"):
        topk_visibility(torch.tensor([[0, 5]]), 5)
    with pytest.raises(ValueError, match="topk indices must be in"):
        topk_visibility(torch.tensor([[-2]]), 5)

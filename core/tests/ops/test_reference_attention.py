"""The reference ops against PyTorch's own float64 scaled_dot_product_attention and a sink formula."""

import pytest
import torch
import torch.nn.functional as F
from jackfield.ops import dense_attention, varlen_attention, visibility_mask


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


def test_rows_without_keys_are_zero_with_minus_inf_lse() -> None:
    visible = torch.tensor([[True, False], [False, False]])
    out, lse = dense_attention(
        torch.randn(2, 1, 4), torch.randn(2, 1, 4), torch.randn(2, 1, 4), 1.0, visible, torch.zeros(1)
    )
    assert torch.equal(out[1], torch.zeros(1, 4)) and lse[1].item() == float("-inf")
    assert torch.isfinite(out).all() and torch.isfinite(lse[0]).all()


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="k_len >= q_len"):
        visibility_mask(4, 3, causal=True)
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

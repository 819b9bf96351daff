"""merge_attn_states against a float64 single pass over the union of keys."""

import pytest
import torch
from jackfield.ops import merge_attn_states


def _attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor):
    """Softmax attention over the keys `keep` selects, float64; empty -> (0, -inf). q [T,H,D], k/v [S,H,D]."""
    s = torch.einsum("thd,shd->ths", q.double(), k.double())
    s = s.masked_fill(~keep[None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), 0.0)
    return torch.einsum("ths,shd->thd", p, v.double()), lse


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_equals_single_pass(seed: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    t, h, d, s = 5, 3, 16, 23
    q, k, v = (torch.randn(n, h, d, generator=g) for n in (t, s, s))
    # seed 0: all keys on side A; seed 1: all on side B; otherwise a random split
    in_a = {0: torch.ones(s, dtype=torch.bool), 1: torch.zeros(s, dtype=torch.bool)}.get(
        seed, torch.rand(s, generator=g) < 0.5
    )
    out_a, lse_a = _attention64(q, k, v, in_a)
    out_b, lse_b = _attention64(q, k, v, ~in_a)
    want, want_lse = _attention64(q, k, v, torch.ones(s, dtype=torch.bool))
    out, lse = merge_attn_states(out_a.to(dtype), lse_a.float(), out_b.to(dtype), lse_b.float())
    assert out.dtype == dtype and lse.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_empty_side_is_exact_identity_and_never_nan() -> None:
    g = torch.Generator().manual_seed(7)
    out_a, lse_a = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, generator=g)
    garbage = torch.full((4, 2, 8), float("nan"))  # whatever an empty partial holds must not leak
    empty = torch.full((4, 2), float("-inf"))
    out, lse = merge_attn_states(out_a, lse_a, garbage, empty)
    assert torch.equal(out, out_a) and torch.equal(lse, lse_a)
    out, lse = merge_attn_states(garbage, empty, out_a, lse_a)
    assert torch.equal(out, out_a) and torch.equal(lse, lse_a)


def test_both_empty_gives_zero_and_minus_inf() -> None:
    empty = torch.full((3, 2), float("-inf"))
    out, lse = merge_attn_states(torch.randn(3, 2, 4), empty, torch.randn(3, 2, 4), empty)
    assert torch.equal(out, torch.zeros(3, 2, 4))
    assert torch.equal(lse, empty)


def test_mixed_rows_some_empty() -> None:
    g = torch.Generator().manual_seed(3)
    out_a, out_b = torch.randn(4, 1, 8, generator=g), torch.randn(4, 1, 8, generator=g)
    lse_a = torch.tensor([[0.5], [float("-inf")], [float("-inf")], [1.0]])
    lse_b = torch.tensor([[float("-inf")], [0.2], [float("-inf")], [1.0]])
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert (
        torch.equal(out[0], out_a[0])
        and torch.equal(out[1], out_b[1])
        and torch.equal(out[2], torch.zeros(1, 8))
    )
    torch.testing.assert_close(out[3], (out_a[3] + out_b[3]) / 2)  # equal weights
    torch.testing.assert_close(lse[3], torch.tensor([1.0 + torch.log(torch.tensor(2.0)).item()]))
    assert not out.isnan().any()


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.randn(2, 3, 4), torch.randn(2, 3), torch.randn(2, 3, 5), torch.randn(2, 3)), "must both be"),
        ((torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)), "must both be"),
        ((torch.randn(2, 3, 4), torch.randn(2, 3), torch.randn(2, 3, 4).half(), torch.randn(2, 3)), "dtype"),
        (
            (torch.randn(2, 3, 4), torch.randn(2, 3).double(), torch.randn(2, 3, 4), torch.randn(2, 3)),
            "float32",
        ),
        ((torch.randn(2, 3, 4), torch.randn(2, 3), torch.randn(2, 3, 4), torch.randn(3, 2)), r"\[T, H\]"),
    ],
)
def test_bad_inputs_are_rejected(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        merge_attn_states(*args)

"""The fused elementwise kernels against the PyTorch ops they replace on CUDA (models/layers.py's
RotaryEmbedding, RMSNorm and GatedMLP paths) and against float64: on the CPU they run in Triton's
interpreter, on a GPU compiled. Inputs are fresh random draws (the seed is printed); outputs start
NaN-poisoned where the kernel writes into a given buffer."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from jackfield.models.layers import RotaryEmbedding

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
                                reason="Triton needs CUDA or TRITON_INTERPRET=1")
DTYPES = [torch.bfloat16, torch.float16]


def mismatch_bound(dtype: torch.dtype) -> float:
    """The share of elements allowed to differ (by up to two units: each of two roundings may
    differ by one): an fma here and there on a GPU. Triton's
    interpreter converts float32 to bf16 by truncation (numpy has no bf16): most values."""
    return 0.8 if dtype == torch.bfloat16 and not CUDA else 0.02


def ulp_mismatches(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(share of elements that differ, largest difference in units of the dtype's spacing at want)."""
    differ = (got != want).float().mean().item()
    spacing = torch.finfo(want.dtype).eps * want.float().abs().clamp(min=torch.finfo(want.dtype).tiny)
    return differ, ((got.float() - want.float()).abs() / spacing).max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, rotary_dim", [(6, 64), (3, 128), (5, 96)])
def test_rope_matches_the_torch_rotation(rng_seed: int, dtype: torch.dtype, heads: int,
                                         rotary_dim: int) -> None:
    from jackfield.ops.fused_triton import rope

    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    table = RotaryEmbedding(inv_freq.float(), 1.0, 4096, interleaved=False).to(DEVICE)
    tokens = 37
    qkv = torch.randn(tokens, heads + 2, rotary_dim, device=DEVICE).to(dtype) * 3
    x = qkv[:, :heads]  # strided rows, as the q/k part of a fused projection
    positions = torch.randint(0, 4096, (tokens,), device=DEVICE)
    want = table(x, positions)  # the PyTorch path (float32 inside, one rounding)
    got = rope(x, table.cos, table.sin, positions)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    differ, worst = ulp_mismatches(got, want)
    assert worst <= 2.0 and differ < mismatch_bound(dtype), (differ, worst)  # an fma apart at most
    # and the rotation itself, against float64 angles
    angles = positions.double().cpu()[:, None] * inv_freq[None]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x64 = x.double().cpu()
    x1, x2 = x64.chunk(2, -1)
    exact = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    spacing = torch.finfo(dtype).eps * exact.abs().max()
    assert (got.double().cpu() - exact).abs().max() <= spacing, "not the half-split rotation"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 2048, 100])
def test_rms_norm_matches_weight_times_f_rms_norm(rng_seed: int, dtype: torch.dtype, hidden: int) -> None:
    from jackfield.ops.fused_triton import rms_norm

    rows = torch.randn(19, hidden + 8, device=DEVICE).to(dtype) * 4
    x = rows[:, :hidden]  # strided rows
    weight = (torch.randn(hidden, device=DEVICE) * 0.5 + 1).to(dtype)
    want = weight * F.rms_norm(x, (hidden,), eps=1e-5)
    got = rms_norm(x, weight, 1e-5)
    differ, worst = ulp_mismatches(got, want)
    assert worst <= 2.0 and differ < mismatch_bound(dtype), (differ, worst)
    x64 = x.double().cpu()
    exact = weight.double().cpu() * x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    assert (got.double().cpu() - exact).abs().max() <= 3 * torch.finfo(dtype).eps * exact.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 100, 2048 + 5])
def test_silu_mul_matches_the_two_torch_ops(rng_seed: int, dtype: torch.dtype, inter: int) -> None:
    from jackfield.ops.fused_triton import silu_mul

    gate_up = (torch.randn(11, 2 * inter, device=DEVICE) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = silu_mul(gate_up)
    differ, worst = ulp_mismatches(got, want)
    assert worst <= 2.0 and differ < mismatch_bound(dtype), (differ, worst)
    g64, u64 = gate.double().cpu(), up.double().cpu()
    exact = g64 * torch.sigmoid(g64) * u64
    assert (got.double().cpu() - exact).abs().max() <= 2 * torch.finfo(dtype).eps * exact.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden, multiplier", [(2048, 1.0), (576, 0.22), (100, 1.0)])
def test_add_rms_norm_matches_the_residual_add_then_the_norm(rng_seed: int, dtype: torch.dtype, hidden: int,
                                                             multiplier: float) -> None:
    from jackfield.models.layers import scaled
    from jackfield.ops.fused_triton import add_rms_norm

    rows = torch.randn(23, hidden + 8, device=DEVICE).to(dtype) * 4
    x = rows[:, :hidden]  # strided rows
    delta = (torch.randn(23, hidden, device=DEVICE) * 3).to(dtype)
    weight = (torch.randn(hidden, device=DEVICE) * 0.5 + 1).to(dtype)
    want_sum = x + scaled(delta, multiplier)  # Granite's residual (the multiplier's product rounded)
    got_sum, got = add_rms_norm(x, delta, weight, 1e-5, multiplier)
    assert got_sum.dtype == got.dtype == dtype and got_sum.is_contiguous() and got.is_contiguous()
    if CUDA:  # roundings of exact products and sums (interpreted: numpy truncates to bf16 instead)
        assert torch.equal(got_sum, want_sum)
    want = weight * F.rms_norm(got_sum, (hidden,), eps=1e-5)  # the norm PyTorch takes of that sum
    differ, worst = ulp_mismatches(got, want)
    assert worst <= 2.0 and differ < mismatch_bound(dtype), (differ, worst)
    # the norm reads the rounded sum: against float64 over that sum
    s64 = got_sum.double().cpu()
    exact = weight.double().cpu() * s64 / (s64.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    assert (got.double().cpu() - exact).abs().max() <= 3 * torch.finfo(dtype).eps * exact.abs().max()
    x64, scaled64 = x.double().cpu(), delta.double().cpu() * multiplier
    bound = 2 * torch.finfo(dtype).eps * (x64.abs() + scaled64.abs())  # a rounding of each operation
    assert ((got_sum.double().cpu() - (x64 + scaled64)).abs() <= bound).all()

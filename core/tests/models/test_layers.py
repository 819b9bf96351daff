"""Building blocks against float64 references written from their definitions: RoPE as a complex
rotation of each pair, RMSNorm as x / sqrt(mean(x^2) + eps), a linear layer's packed and plain
CPU products as x W^T, and the one-token routed-experts path against the same token inside a
larger batch."""

from __future__ import annotations

import random

import pytest
import torch
from jackfield.models.layers import HEAD_PACKED_MIN_ROWS, PACKED_MIN_ROWS, Linear, RMSNorm, RotaryEmbedding
from jackfield.models.moe import Experts


def _rope_reference(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Pair j (x_2j, x_2j+1) when interleaved, else (x_j, x_j+d/2), rotated by position * inv_freq[j]
    as a complex product; returned half-split [rotated firsts ‖ rotated seconds], float64."""
    x = x.double()
    half = x.shape[-1] // 2
    first, second = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    angle = positions.double()[:, None, None] * inv_freq.double()
    rotated = torch.complex(first, second) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat((rotated.real, rotated.imag), dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_complex_rotation(interleaved: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(int(interleaved))
    rotary_dim, max_positions = 32, 300
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    rope = RotaryEmbedding(inv_freq, 1.0, max_positions, interleaved)
    x = torch.randn(5, 3, rotary_dim).to(dtype)
    positions = torch.randint(0, max_positions, (5,))
    got = rope(x, positions)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # float32: the table's angles are rounded products
    torch.testing.assert_close(
        got.double(), _rope_reference(x, positions, inv_freq, interleaved), rtol=tol, atol=tol
    )


@pytest.mark.parametrize("rows", [1, 2, PACKED_MIN_ROWS, 9])
@pytest.mark.parametrize("packed_min_rows", [HEAD_PACKED_MIN_ROWS, PACKED_MIN_ROWS])
def test_cpu_linear_matches_float64(rows: int, packed_min_rows: int) -> None:
    """A float32 CPU Linear with oneDNN's packed copy (an LM head packs from HEAD_PACKED_MIN_ROWS,
    the others from PACKED_MIN_ROWS): x W^T on either side of the threshold, as x W^T in float64."""
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(96, 200, torch.float32, packed_min_rows=packed_min_rows)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(200, 96, generator=gen))
    layer.pack_for_cpu()
    x = torch.randn(rows, 96, generator=gen)
    torch.testing.assert_close(layer(x).double(), x.double() @ layer.weight.double().T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shared", [False, True])
def test_cpu_wide_linear_keeps_its_values_and_a_shared_weight_its_rows(shared: bool) -> None:
    """A wide float32 CPU weight (more outputs than inputs) is read column-major for few rows:
    its values stay those loaded, products at every row count are x W^T in float64, and a
    weight shared with an embedding keeps its contiguous rows (the lookup reads them)."""
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    loaded = torch.randn(200, 96, generator=gen)
    embedding = torch.nn.Parameter(loaded.clone(), requires_grad=False)
    layer = Linear(96, 200, torch.float32, weight=embedding if shared else None)
    if not shared:
        with torch.no_grad():
            layer.weight.copy_(loaded)
    layer.pack_for_cpu()
    assert torch.equal(layer.weight, loaded)
    if shared:
        assert embedding.is_contiguous() and layer.weight is embedding
    for rows in (1, PACKED_MIN_ROWS - 1, PACKED_MIN_ROWS, 9):
        x = torch.randn(rows, 96, generator=gen)
        torch.testing.assert_close(layer(x).double(), x.double() @ loaded.double().T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_float64(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    norm = RMSNorm(64, 1e-6, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = (torch.randn(7, 64) * 3).to(dtype)
    x64 = x.double()
    want = norm.weight.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    got = norm(x)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)],
)
def test_bf16_rms_norm_rounds_as_the_reference(device: str) -> None:
    """16-bit RMSNorm: normalized in float32, rounded to bf16, then scaled by the bf16 weight
    (DeepSeek's reference order) — bit for bit, on fresh random rows."""
    torch.manual_seed(5)
    norm = RMSNorm(512, 1e-6, torch.bfloat16).to(device)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(512))
    x = (torch.randn(257, 512, device=device) * 3).bfloat16()
    x32 = x.float()
    want = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    got = norm(x)
    mismatched = (got != want).float().mean().item()
    assert mismatched < 1e-3, f"{mismatched:.2%} of values differ from the reference rounding"


def test_one_token_experts_match_the_batched_path() -> None:
    """Batch-1 decode takes its own path; its result is the same token's row in a larger batch."""
    torch.manual_seed(4)
    experts = Experts(6, 32, 24, torch.float32)
    with torch.no_grad():
        experts.w13.normal_(0, 32**-0.5)
        experts.w2.normal_(0, 24**-0.5)
    x = torch.randn(5, 32)
    ids = torch.stack([torch.randperm(6)[:3] for _ in range(5)])
    weights = torch.rand(5, 3)
    batched = experts(x, weights, ids)
    for t in range(5):
        one = experts(x[t : t + 1], weights[t : t + 1], ids[t : t + 1])
        torch.testing.assert_close(one, batched[t : t + 1], rtol=1e-6, atol=1e-6)

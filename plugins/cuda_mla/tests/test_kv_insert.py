"""KV insert kernel vs the core's plain-PyTorch quantize (small shapes; CPU interpreter in CI)."""

from __future__ import annotations

import pytest
import torch
from jackfield.attention.kv_cache import quantize
from jackfield_cuda_mla.kernels import mla_kv_insert

DEV = "cuda" if torch.cuda.is_available() else "cpu"
RANK, ROPE, PAGE = 64, 16, 16
FP8 = torch.float8_e4m3fn


def poisoned_cache(num_blocks: int, dtype: torch.dtype, width: int = RANK + ROPE) -> torch.Tensor:
    cache = torch.full((num_blocks, PAGE, width), float("nan"), device=DEV)
    return cache.to(dtype)  # NaN survives the cast to fp8 e4m3fn (0x7f)


def insert_case(
    tokens: int,
    dtype: torch.dtype,
    act: torch.dtype,
    scale: float | None = None,
    rank: int = RANK,
    rope: int = ROPE,
):
    num_blocks = tokens // PAGE + 4
    cache = poisoned_cache(num_blocks, dtype, rank + rope)
    kv_c = torch.randn(tokens, rank, device=DEV).to(act) * 3
    k_pe = torch.randn(tokens, rope, device=DEV).to(act) * 3
    slots = torch.randperm(num_blocks * PAGE, device=DEV)[:tokens]
    slots[torch.rand(tokens, device=DEV) < 0.1] = -1
    kv_scale = None if scale is None else torch.tensor([scale], device=DEV)
    mla_kv_insert(kv_c, k_pe, cache, slots, kv_scale)
    expected = quantize(torch.cat([kv_c.double(), k_pe.double()], 1), dtype, kv_scale)
    return cache.view(-1, rank + rope), slots, expected


@pytest.mark.parametrize(
    "dtype,act",
    [
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
    ],
)
@pytest.mark.parametrize("tokens", [1, 37])
def test_insert_writes_exactly_the_live_slots(tokens: int, dtype: torch.dtype, act: torch.dtype) -> None:
    flat, slots, expected = insert_case(tokens, dtype, act)
    live = slots >= 0
    if dtype == act:  # a copy: bit exact
        assert torch.equal(flat[slots[live]].float(), expected[live].float())
    else:  # a rounding: within one ulp (the CPU interpreter truncates fp32 -> bf16)
        torch.testing.assert_close(flat[slots[live]].float(), expected[live].float(), rtol=2**-7, atol=0)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEV)
    untouched[slots[live]] = False
    assert bool(flat[untouched].float().isnan().all()), "a slot outside slot_mapping was written"


@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_insert_fp8_quantizes_with_the_scale(scale: float) -> None:
    flat, slots, expected = insert_case(53, FP8, torch.float16, scale)
    live = slots >= 0
    got, want = flat[slots[live]].float(), expected[live].float()
    if DEV == "cuda":
        assert torch.equal(got, want)
    else:  # the CPU interpreter rounds fp8 loosely: ties, subnormals, and a dropped carry to 2^k
        one_ulp = (got - want).abs() <= want.abs() * 2**-3 + 2**-9
        lost_carry = (want == 2 * got) & (want.abs().log2() % 1 == 0)
        assert bool((one_ulp | lost_carry).all())
        assert int((got != want).sum()) < want.numel() // 10


def test_insert_odd_widths_follow_the_cache_shape() -> None:
    flat, slots, expected = insert_case(20, torch.float16, torch.float16, rank=48, rope=8)
    live = slots >= 0
    assert torch.equal(flat[slots[live]].float(), expected[live].float())


def test_insert_16k_tokens_in_one_call() -> None:
    tokens = 16384
    flat, slots, expected = insert_case(tokens, torch.float16, torch.float16, rank=16, rope=16)
    live = slots >= 0
    assert int(live.sum()) > 14000
    assert torch.equal(flat[slots[live]].float(), expected[live].float())


def test_slot_range_is_checked_per_tensor_version_and_cache() -> None:
    """The remembered range check must still fail on every change that could make a slot bad."""
    rows = lambda n: (torch.randn(n, RANK, device=DEV), torch.randn(n, ROPE, device=DEV))  # noqa: E731
    big, small = poisoned_cache(8, torch.float32), poisoned_cache(2, torch.float32)
    slots = torch.tensor([3, 5 * PAGE, 1], device=DEV)
    mla_kv_insert(*rows(3), big, slots)  # in range for 8 blocks: checked once, remembered
    mla_kv_insert(*rows(3), big, slots)
    with pytest.raises(ValueError, match=f"slot_mapping holds slot {5 * PAGE}"):
        mla_kv_insert(*rows(3), small, slots)  # same tensor, smaller cache: checked again
    slots[0] = 8 * PAGE  # in place: the version counter moves
    with pytest.raises(ValueError, match=f"slot_mapping holds slot {8 * PAGE}"):
        mla_kv_insert(*rows(3), big, slots)


def test_inference_mode_slots_are_checked_on_every_call() -> None:
    """Inference tensors have no version counter: nothing is remembered, each call checks."""
    cache = poisoned_cache(2, torch.float32)
    with torch.inference_mode():
        slots = torch.tensor([0, 1, 2], device=DEV)
        kv_c, k_pe = torch.randn(3, RANK, device=DEV), torch.randn(3, ROPE, device=DEV)
        mla_kv_insert(kv_c, k_pe, cache, slots)
        slots[1] = 2 * PAGE  # in place, untracked
        with pytest.raises(ValueError, match=f"slot_mapping holds slot {2 * PAGE}"):
            mla_kv_insert(kv_c, k_pe, cache, slots)


def test_kernel_skips_slots_past_the_cache_even_unchecked() -> None:
    """A write through .data does not move the version counter: the kernel's own bound holds."""
    buffer = poisoned_cache(3, torch.float32)
    cache = buffer[:2]  # block 2 is the memory a stray write past the cache would hit
    slots = torch.tensor([0, 1, 2], device=DEV)
    kv_c, k_pe = torch.randn(3, RANK, device=DEV), torch.randn(3, ROPE, device=DEV)
    mla_kv_insert(kv_c, k_pe, cache, slots)
    buffer.fill_(float("nan"))
    slots.data[1] = 2 * PAGE  # one past the last slot, invisible to the remembered check
    mla_kv_insert(kv_c, k_pe, cache, slots)
    flat = buffer.view(-1, RANK + ROPE)
    assert torch.equal(flat[[0, 2]], torch.cat([kv_c, k_pe], 1)[[0, 2]])
    assert bool(flat[[1, *range(3, 3 * PAGE)]].isnan().all())

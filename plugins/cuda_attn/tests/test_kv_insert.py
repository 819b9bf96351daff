"""KV insert kernel vs the core's plain-PyTorch quantize (small shapes; CPU interpreter in CI)."""

from __future__ import annotations

import pytest
import torch
from jackfield.attention.kv_cache import key_scale, quantize, value_scale
from jackfield_cuda_attn.kernels import mha_kv_insert

DEV = "cuda" if torch.cuda.is_available() else "cpu"
KV_HEADS, HEAD_SIZE, PAGE = 2, 32, 16
FP8 = torch.float8_e4m3fn


def poisoned_cache(num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    cache = torch.full((2, num_blocks, PAGE, KV_HEADS, HEAD_SIZE), float("nan"), device=DEV)
    return cache.to(dtype)  # NaN survives the cast to fp8 e4m3fn (0x7f)


def rows(tokens: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    key, value = (torch.randn(tokens, KV_HEADS, HEAD_SIZE, device=DEV).to(dtype) * 3 for _ in "kv")
    return key, value


def insert_case(tokens: int, dtype: torch.dtype, act: torch.dtype, scale: float | None = None):
    """Insert into a poisoned cache at random slots, 10% of them -1; returns the flat halves
    [2, slots, H_kv, D], the slots and what torch's quantize stores."""
    num_blocks = tokens // PAGE + 4
    cache = poisoned_cache(num_blocks, dtype)
    key, value = rows(tokens, act)
    slots = torch.randperm(num_blocks * PAGE, device=DEV)[:tokens]
    slots[torch.rand(tokens, device=DEV) < 0.1] = -1
    kv_scale = None if scale is None else torch.tensor([scale, 1.5 * scale], device=DEV)  # key, value
    mha_kv_insert(key, value, cache, slots, kv_scale)
    expected = torch.stack([quantize(key.double(), dtype, key_scale(kv_scale)),
                            quantize(value.double(), dtype, value_scale(kv_scale))])
    return cache.flatten(1, 2), slots, expected


@pytest.mark.parametrize(
    "dtype,act",
    [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
@pytest.mark.parametrize("tokens", [1, 37])
def test_insert_writes_exactly_the_live_slots(tokens: int, dtype: torch.dtype, act: torch.dtype) -> None:
    flat, slots, expected = insert_case(tokens, dtype, act)
    live = slots >= 0
    got, want = flat[:, slots[live]].float(), expected[:, live].float()
    if dtype == act:  # a copy: bit exact
        assert torch.equal(got, want)
    else:  # a rounding: within one ulp (the CPU interpreter truncates fp32 -> bf16)
        torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=DEV)
    untouched[slots[live]] = False
    assert bool(flat[:, untouched].float().isnan().all()), "a slot outside slot_mapping was written"


@pytest.mark.parametrize("scale", [0.01, 1.0])
def test_insert_fp8_quantizes_with_the_scale(scale: float) -> None:
    """Round trip: the stored bytes are torch's clamp(x / scale) cast, keys by `scale`, values by
    1.5 x `scale`; scale 0.01 saturates some (|x| up to ~12 / 0.015 > 448)."""
    flat, slots, expected = insert_case(53, FP8, torch.float16, scale)
    live = slots >= 0
    got, want = flat[:, slots[live]].float(), expected[:, live].float()
    if scale == 0.01:
        assert bool((want.abs() == 448).any()), "no value saturated: the clamp went untested"
    if DEV == "cuda":
        assert torch.equal(got, want)
    else:  # the CPU interpreter rounds fp8 loosely: ties, subnormals, and a dropped carry to 2^k
        one_ulp = (got - want).abs() <= want.abs() * 2**-3 + 2**-9
        lost_carry = (want == 2 * got) & (want.abs().log2() % 1 == 0)
        assert bool((one_ulp | lost_carry).all())
        assert int((got != want).sum()) < want.numel() // 10


def test_strided_rows_from_a_fused_projection() -> None:
    """key and value as views into one [T, (H + 2 H_kv) D] projection output (last stride 1)."""
    tokens, heads = 20, 4
    qkv = torch.randn(tokens, (heads + 2 * KV_HEADS) * HEAD_SIZE, device=DEV).to(torch.float16)
    _, key, value = qkv.view(tokens, heads + 2 * KV_HEADS, HEAD_SIZE).split([heads, KV_HEADS, KV_HEADS], 1)
    cache = poisoned_cache(4, torch.float16)
    slots = torch.arange(tokens, device=DEV)
    mha_kv_insert(key, value, cache, slots)
    flat = cache.flatten(1, 2)
    assert torch.equal(flat[0, :tokens], key) and torch.equal(flat[1, :tokens], value)


def test_slot_range_is_checked_per_tensor_version_and_cache() -> None:
    """The remembered range check must still fail on every change that could make a slot bad."""
    big, small = poisoned_cache(8, torch.float16), poisoned_cache(2, torch.float16)
    slots = torch.tensor([3, 5 * PAGE, 1], device=DEV)
    mha_kv_insert(*rows(3), big, slots)  # in range for 8 blocks: checked once, remembered
    mha_kv_insert(*rows(3), big, slots)
    with pytest.raises(ValueError, match=f"slot_mapping holds slot {5 * PAGE}"):
        mha_kv_insert(*rows(3), small, slots)  # same tensor, smaller cache: checked again
    slots[0] = 8 * PAGE  # in place: the version counter moves
    with pytest.raises(ValueError, match=f"slot_mapping holds slot {8 * PAGE}"):
        mha_kv_insert(*rows(3), big, slots)


def test_inference_mode_slots_are_checked_on_every_call() -> None:
    """Inference tensors have no version counter: nothing is remembered, each call checks."""
    cache = poisoned_cache(2, torch.float16)
    with torch.inference_mode():
        slots = torch.tensor([0, 1, 2], device=DEV)
        key, value = rows(3)
        mha_kv_insert(key, value, cache, slots)
        slots[1] = 2 * PAGE  # in place, untracked
        with pytest.raises(ValueError, match=f"slot_mapping holds slot {2 * PAGE}"):
            mha_kv_insert(key, value, cache, slots)


def test_kernel_skips_slots_past_the_cache_even_unchecked() -> None:
    """A write through .data does not move the version counter: the kernel's own bound holds.
    Past the key half's last slot lies the value half's first; past the value half, a spare block."""
    buffer = torch.full((5, PAGE, KV_HEADS, HEAD_SIZE), float("nan"), device=DEV, dtype=torch.float16)
    cache = buffer[:4].view(2, 2, PAGE, KV_HEADS, HEAD_SIZE)  # 2 blocks of keys, 2 of values
    slots = torch.tensor([5, 1, 2], device=DEV)
    key, value = rows(3, torch.float16)
    mha_kv_insert(key, value, cache, slots)
    buffer.fill_(float("nan"))
    slots.data[1] = 2 * PAGE  # one past the last slot, invisible to the remembered check
    mha_kv_insert(key, value, cache, slots)
    flat = cache.flatten(1, 2)
    assert torch.equal(flat[0, [5, 2]], key[[0, 2]]) and torch.equal(flat[1, [5, 2]], value[[0, 2]])
    assert bool(flat[1, 0].isnan().all()), "a key was written past the key half"
    assert bool(buffer[4].isnan().all()), "a value was written past the cache"


def test_bad_inputs_are_named() -> None:
    cache = poisoned_cache(2, torch.float16)
    key, value = rows(3, torch.float16)
    slots = torch.tensor([0, 1, 2], device=DEV)
    with pytest.raises(ValueError, match=r"key must be \[T, 2, 32\]"):
        mha_kv_insert(key[:, :1], value, cache, slots)
    with pytest.raises(ValueError, match="value dtype torch.float64"):
        mha_kv_insert(key, value.double(), cache, slots)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        mha_kv_insert(key, value, cache, slots[:2])
    with pytest.raises(ValueError, match="needs kv_scale"):
        mha_kv_insert(key, value, cache.to(FP8), slots)
    with pytest.raises(ValueError, match="kv_cache must be"):
        mha_kv_insert(key, value, cache[0], slots)

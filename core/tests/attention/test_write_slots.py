"""write_slots, the plain-PyTorch KV write that a CUDA graph may record: against a row-by-row write,
byte for byte (NaN-poisoned slots included), with padding rows (slot -1) anywhere in the step, and
in a step with no real row at all."""

from __future__ import annotations

import pytest
import torch
from jackfield.attention.kv_cache import FP8_DTYPE, write_slots


def row_by_row(flat: torch.Tensor, slots: list[int], rows: torch.Tensor) -> torch.Tensor:
    want = flat.clone()
    for i, slot in enumerate(slots):
        if slot >= 0:
            want[slot] = rows[i]
    return want


@pytest.mark.parametrize(("dtype", "record"),
                         [(torch.float32, (2, 3)), (torch.bfloat16, (5,)), (FP8_DTYPE, (6,))])
@pytest.mark.parametrize("real_rows", [0, 1, 4])
def test_write_slots_writes_the_real_rows_only(dtype: torch.dtype, record: tuple[int, ...], real_rows: int,
                                               rng_seed: int) -> None:
    print(f"seed={rng_seed}")
    gen = torch.Generator().manual_seed(rng_seed)
    num_slots, step = 24, 7
    flat = torch.randn(num_slots, *record, generator=gen).to(dtype)
    flat.view(torch.uint8)[0] = 0xFF  # slot 0: NaN in every dtype here, its bytes kept as they are
    rows = torch.randn(step, *record, generator=gen).to(dtype)
    slots = [-1] * step
    chosen = torch.randperm(num_slots, generator=gen)[:real_rows].tolist()  # slot 0 among them at times
    for place, slot in zip(torch.randperm(step, generator=gen)[:real_rows].tolist(), chosen, strict=True):
        slots[place] = slot
    want = row_by_row(flat, slots, rows)
    write_slots(flat, torch.tensor(slots, dtype=torch.int64), rows)
    assert torch.equal(flat.view(torch.uint8), want.view(torch.uint8)), slots

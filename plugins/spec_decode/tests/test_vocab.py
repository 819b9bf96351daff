"""draft_to_target_ids: the identity sentinel, the published offsets rule, and bad maps refused."""

from __future__ import annotations

import pytest
import torch
from jackfield_spec_decode.vocab import draft_to_target_ids

SOURCE = "/heads/eagle/model.safetensors: d2t"


def test_equal_vocabularies_need_no_map() -> None:
    assert draft_to_target_ids(50, 50, None, source=SOURCE) is None
    assert draft_to_target_ids(50, 50, torch.zeros(50, dtype=torch.int64), source=SOURCE) is None


def test_offsets_map_draft_ids_into_the_target_vocabulary(rng_seed: int) -> None:
    g = torch.Generator().manual_seed(rng_seed)
    target_ids = torch.randperm(1000, generator=g)[:64].sort().values  # how published heads pick theirs
    d2t = target_ids - torch.arange(64)
    got = draft_to_target_ids(64, 1000, d2t, source=SOURCE)
    assert got is not None and got.dtype == torch.int64
    assert got.tolist() == [i + int(d2t[i]) for i in range(64)]


@pytest.mark.parametrize(("d2t", "match"), [
    (None, "d2t is missing"),
    (torch.zeros(7, dtype=torch.int64), r"shape \[8\]"),
    (torch.zeros(8, dtype=torch.float32), "integer offsets"),
    (torch.tensor([0, 0, 0, 0, 0, 0, 0, 20]), "draft id 7 maps to 27, outside"),
    (torch.tensor([0, 0, 0, 0, 0, 0, 0, -8]), "draft id 7 maps to -1, outside"),
    (torch.tensor([0, 0, 0, 0, 0, 0, 0, -1]), "several draft ids map to one"),
])
def test_bad_maps_name_the_file_and_tensor(d2t: torch.Tensor | None, match: str) -> None:
    with pytest.raises(ValueError, match=match) as caught:
        draft_to_target_ids(8, 20, d2t, source=SOURCE)
    assert SOURCE in str(caught.value)


def test_a_draft_vocabulary_larger_than_the_target_is_refused() -> None:
    with pytest.raises(ValueError, match="larger than the target"):
        draft_to_target_ids(30, 20, torch.zeros(30, dtype=torch.int64), source=SOURCE)

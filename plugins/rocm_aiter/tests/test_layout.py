"""AITER's page-size-1 layout of a decode batch, against a position-by-position reading of the
block tables; the builder's pass-through of prefill metadata, and the causal flag staying on each
metadata instance."""

from __future__ import annotations

import pytest
import torch
from jackfield.testing.problems import make_batch
from jackfield_rocm_aiter.layout import LAYOUT_KEY, AiterDecodeLayout, RocmAiterMetadataBuilder, layout_for


def expected_slots(block_table: torch.Tensor, seq_lens: list[int], block_size: int) -> list[int]:
    return [int(block_table[b, p // block_size]) * block_size + p % block_size
            for b, seq_len in enumerate(seq_lens) for p in range(seq_len)]


@pytest.mark.parametrize("block_size", [1, 16])
def test_a_ragged_decode_batch(block_size: int, gen: torch.Generator) -> None:
    """q_lens [3, 1, 2]: every request padded to 3 rows, its own rows last."""
    q_lens, seq_lens = [3, 1, 2], [3 + 2 * block_size, 7, 2]
    md = make_batch(q_lens, seq_lens, 3, block_size, "cpu", gen).metadata
    layout = RocmAiterMetadataBuilder().build(md).extra[LAYOUT_KEY]
    assert isinstance(layout, AiterDecodeLayout)
    assert layout.query_len == 3
    assert layout.qo_indptr.tolist() == [0, 3, 6, 9] and layout.qo_indptr.dtype == torch.int32
    assert layout.kv_indptr.tolist() == [0, seq_lens[0], seq_lens[0] + 7, sum(seq_lens)]
    assert layout.kv_last_page_lens.tolist() == [1, 1, 1]
    assert layout.padded_rows is not None and layout.padded_rows.tolist() == [0, 1, 2, 5, 7, 8]
    kv_indices = layout.kv_indices(block_size)
    assert kv_indices.dtype == torch.int32
    assert kv_indices.tolist() == expected_slots(md.block_table, seq_lens, block_size)


def test_a_uniform_batch_is_not_padded(gen: torch.Generator) -> None:
    md = make_batch([2, 2], [5, 9], 2, 4, "cpu", gen).metadata
    layout = layout_for(md)
    assert layout.padded_rows is None and layout.qo_indptr.tolist() == [0, 2, 4]


def test_slots_follow_the_cache_s_block_size(gen: torch.Generator) -> None:
    """The same block table read for two cache block sizes (the block size is the cache's)."""
    md = make_batch([1, 1], [9, 17], 2, 16, "cpu", gen).metadata
    layout = layout_for(md)
    for block_size in (16, 32):
        assert layout.kv_indices(block_size).tolist() == expected_slots(md.block_table, [9, 17], block_size)
    assert layout.kv_indices(16) is layout.kv_indices(16)  # kept for the step's other layers


def test_prefill_metadata_passes_through(gen: torch.Generator) -> None:
    md = make_batch([5, 9], [5, 12], 0, 16, "cpu", gen).metadata
    assert RocmAiterMetadataBuilder().build(md) is md


def test_the_causal_flag_stays_on_each_metadata_instance(gen: torch.Generator) -> None:
    """One builder builds a causal and a non-causal batch: each result keeps its own flag, the
    builder keeps nothing between builds."""
    builder = RocmAiterMetadataBuilder()
    causal = builder.build(make_batch([2, 2], [4, 6], 2, 16, "cpu", gen).metadata)
    drafts = builder.build(make_batch([3, 3], [5, 8], 2, 16, "cpu", gen, causal=False).metadata)
    assert causal.causal and not drafts.causal
    assert vars(builder) == {}


def test_a_copy_with_other_tensors_gets_its_own_layout(gen: torch.Generator) -> None:
    """metadata.replace shares `extra`: a layout serves only the tensors it was built from."""
    md = RocmAiterMetadataBuilder().build(make_batch([1, 1], [4, 6], 2, 16, "cpu", gen).metadata)
    assert layout_for(md) is md.extra[LAYOUT_KEY]
    shorter = md.replace(seq_lens=md.seq_lens - 1, seq_lens_cpu=md.seq_lens_cpu - 1, max_seq_len=5)
    assert layout_for(shorter).kv_indptr.tolist() == [0, 3, 8]

"""Chunk keys and the sliding-window chunk rule: the issue's formula table, the (group, chunk)
matrix of one request, and the boundary derived from the coverage spec's first retained block."""

from __future__ import annotations

import pytest
from jackfield.contracts.kv_connector import KVCoverageSpec
from jackfield_kv_offload import sliding_window_size_in_chunks
from jackfield_kv_offload.keys import ChunkKey, GroupChunking, chunk_keys, group_chunkings


@pytest.mark.parametrize(("window", "chunk", "extra", "expected"), [
    (8, 4, 0, 2),
    (8, 4, 1, 2),  # retaining one token needs no extra chunk
    (8, 4, 2, 3),
    (1, 4, 0, 1),
    (16, 16, 0, 1),
    (17, 16, 0, 2),
    (16, 16, 1, 1),
    (16, 16, 2, 2),
])
def test_window_size_in_chunks(window: int, chunk: int, extra: int, expected: int) -> None:
    assert sliding_window_size_in_chunks(window, chunk, extra) == expected


def test_window_size_in_chunks_rejects_bad_input() -> None:
    for args in ((0, 4, 0), (8, 0, 0), (8, 4, -1)):
        with pytest.raises(ValueError):
            sliding_window_size_in_chunks(*args)


def test_chunk_keys_name_each_full_chunks_last_block() -> None:
    hashes = [11, 22, 33, 44, 55, 66, 77]
    assert chunk_keys(hashes, 1, 3) == [ChunkKey(1, 33), ChunkKey(1, 66)]
    assert chunk_keys(hashes, 0, 1) == [ChunkKey(0, h) for h in hashes]
    assert chunk_keys(hashes[:2], 0, 3) == []


def _matrix(num_tokens: int, extra: int) -> list[tuple[int, int]]:
    """(group, chunk) pairs stored for one request: group 0 full attention with 16-token blocks,
    group 1 a window of 8 with 4-token blocks, one block per chunk."""
    chunkings = group_chunkings([KVCoverageSpec(16), KVCoverageSpec(4, sliding_window=8)], [1, 1], extra)
    return [(g, c) for g, ch in enumerate(chunkings)
            for c in range(num_tokens // ch.tokens_per_chunk) if ch.reachable(c)]


def test_store_matrix_of_a_full_and_a_window_group() -> None:
    assert _matrix(32, 0) == [(0, 0), (0, 1), (1, 2), (1, 3), (1, 6), (1, 7)]


def test_store_matrix_widens_with_retained_tokens_not_the_window() -> None:
    chunkings = group_chunkings([KVCoverageSpec(16), KVCoverageSpec(4, sliding_window=8)], [1, 1], 2)
    assert chunkings[1].coverage.sliding_window == 8  # the model's window is untouched
    assert _matrix(32, 2) == [(0, 0), (0, 1), (1, 1), (1, 2), (1, 3), (1, 5), (1, 6), (1, 7)]


@pytest.mark.parametrize("extra", [0, 1, 2, 5])
def test_store_boundary_is_the_first_retained_block(extra: int) -> None:
    """Every segment end is a resume point: the window chunks stored there begin at the block
    holding the first token the coverage spec still needs (no hard-coded offsets)."""
    coverage = KVCoverageSpec(4, sliding_window=8).with_changes(retained_extra_tokens=extra)
    window = GroupChunking(coverage, 1, 16)
    stored = {c for c in range(16) if window.reachable(c)}
    for segment_end in (16, 32, 48, 64):
        first_block = coverage.needed_token_range(segment_end).start // coverage.block_size
        in_segment = set(range((segment_end - 16) // 4, segment_end // 4))
        assert stored & in_segment == set(range(first_block, segment_end // 4)), segment_end
        assert set(window.needed_chunks(segment_end // 16)) == set(range(first_block, segment_end // 4))


def test_equal_chunks_store_every_window_chunk_and_load_only_the_window() -> None:
    full, window = group_chunkings([KVCoverageSpec(16), KVCoverageSpec(16, sliding_window=40)], [2, 2], 0)
    assert all(window.reachable(c) for c in range(10))
    assert window.needed_chunks(5) == range(3, 5)  # 40 tokens of a 32-token chunk: 2 chunks
    assert full.needed_chunks(5) == range(0, 5)


def test_chunking_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="blocks_per_chunk"):
        GroupChunking(KVCoverageSpec(16), 0, 16)
    with pytest.raises(ValueError, match="whole number"):
        GroupChunking(KVCoverageSpec(16), 1, 24)

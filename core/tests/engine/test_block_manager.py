from __future__ import annotations

import pytest
from jackfield import SamplingParams
from jackfield.engine.block_manager import BlockManager
from jackfield.engine.sequence import Sequence


def _seq(request_id: int, tokens: list[int]) -> Sequence:
    return Sequence(request_id, len(tokens), list(tokens), SamplingParams(), 0)


def _run_prefill(bm: BlockManager, seq: Sequence) -> None:
    hits = bm.match_prefix(seq)
    bm.admit(seq, hits)
    bm.grow(seq, seq.num_tokens)
    seq.num_computed = seq.num_tokens
    bm.commit(seq)


def test_shared_prefix_reuses_full_blocks_and_counts_references() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = _seq(0, list(range(10)))  # 2 full blocks + 2 tokens
    _run_prefill(bm, a)
    b = _seq(1, list(range(8)) + [99, 98, 97])
    hits = bm.match_prefix(b)  # one table per KV cache group
    assert hits == [a.block_table[:2]]
    bm.admit(b, hits)
    assert b.num_computed == 8
    assert all(bm.blocks[i].ref_count == 2 for i in hits[0])
    bm.release(a)
    assert all(bm.blocks[i].ref_count == 1 for i in hits[0])


def test_the_last_prompt_token_is_never_served_from_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    _run_prefill(bm, _seq(0, list(range(8))))
    assert len(bm.match_prefix(_seq(1, list(range(8))))[0]) == 1  # block 2 holds the last token: recomputed


def test_freed_blocks_stay_cached_until_reused_and_different_prefixes_miss() -> None:
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    a = _seq(0, list(range(9)))
    _run_prefill(bm, a)
    bm.release(a)
    assert bm.num_free == 3
    again = _seq(1, list(range(9)))
    assert len(bm.match_prefix(again)[0]) == 2
    assert bm.match_prefix(_seq(2, [7] + list(range(1, 9)))) == [[]]  # first block differs: chain breaks
    other = _seq(3, [50 + i for i in range(12)])
    bm.admit(other, [[]])
    bm.grow(other, 12)  # takes every block, evicting the cached ones
    assert bm.match_prefix(again) == [[]]


def test_disabled_prefix_caching_never_matches() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    _run_prefill(bm, _seq(0, list(range(10))))
    assert bm.match_prefix(_seq(1, list(range(10)))) == [[]]


def test_bad_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="positive"):
        BlockManager(num_blocks=0, block_size=4, enable_prefix_caching=True)


def test_a_model_drafter_s_hit_leaves_its_last_block_to_be_computed_again() -> None:
    """With drop_last_hit_block (a model drafter's KV at a position read the token after it), a
    hit of k blocks serves k - 1; the token after those is inside the matched k-th block."""
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=True, drop_last_hit_block=True)
    a = _seq(0, list(range(14)))
    _run_prefill(bm, a)
    b = _seq(1, list(range(12)) + [99, 98])
    assert bm.match_prefix(b) == [a.block_table[:2]]  # 3 blocks match
    assert bm.match_prefix(_seq(2, list(range(5)))) == [[]]  # 1 block matches
    with pytest.raises(ValueError, match="full-attention KV cache groups only"):
        BlockManager(8, 4, True, windows=(None, 6), drop_last_hit_block=True)

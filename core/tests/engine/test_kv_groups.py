"""KV cache groups: planning, and a sliding-window group's table handing back blocks no future
query sees (chunked prefill, decode, prefix hits), checked against the window's definition."""

from __future__ import annotations

import random

import pytest
from jackfield import SamplingParams
from jackfield.contracts.attention import AttentionLayerSpec
from jackfield.engine.block_manager import NULL_BLOCK, BlockManager, max_request_blocks
from jackfield.engine.kv_groups import plan_kv_cache_groups
from jackfield.engine.scheduler import Scheduler
from jackfield.engine.sequence import Sequence


def _layer(window: int | None, heads: int = 2) -> AttentionLayerSpec:
    return AttentionLayerSpec(num_heads=4, head_size=8, scale=0.3, num_kv_heads=heads, sliding_window=window)


def _seq(request_id: int, tokens: list[int]) -> Sequence:
    return Sequence(request_id, len(tokens), list(tokens), SamplingParams(), 0)


def test_one_pattern_is_one_group_with_a_tensor_per_layer() -> None:
    for window in (None, 5):
        groups = plan_kv_cache_groups([_layer(window)] * 3)
        assert groups.windows == (window,) and not groups.hybrid
        assert groups.layer_group == (0, 0, 0) and groups.layer_tensor == (0, 1, 2)
        assert groups.num_tensors == 3


def test_hybrid_layers_split_into_equal_groups_sharing_tensors() -> None:
    # Granite SWA's default pattern for 6 layers: full at 0 and 4.
    windows = [None, 8, 8, 8, None, 8]
    groups = plan_kv_cache_groups([_layer(w) for w in windows])
    assert groups.windows == (None, 8, 8) and groups.num_tensors == 2  # 2 full layers: groups of 2
    assert groups.layer_group == (0, 1, 1, 2, 0, 2)
    assert groups.layer_tensor == (0, 0, 1, 0, 1, 1)
    for g in range(3):  # each group uses each tensor once
        pairs = zip(groups.layer_tensor, groups.layer_group, strict=True)
        assert sorted(t for t, lg in pairs if lg == g) == [0, 1]


def test_hybrid_layers_with_different_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="share one KV cache layout"):
        plan_kv_cache_groups([_layer(None, heads=2), _layer(4, heads=1)])
    with pytest.raises(ValueError, match="at least one"):
        plan_kv_cache_groups([])


def test_bad_windows_and_pools_are_rejected() -> None:
    with pytest.raises(ValueError, match="one window per KV cache group"):
        BlockManager(8, 4, False, windows=())
    with pytest.raises(ValueError, match="one window per KV cache group"):
        BlockManager(8, 4, False, windows=(None, 0))
    with pytest.raises(ValueError, match="null block"):
        BlockManager(1, 4, False, windows=(3,))


def _needed_blocks(num_computed: int, window: int, block_size: int, table_len: int) -> set[int]:
    """Block indices the next query (at num_computed) or any later one may read, by definition."""
    return {p // block_size for p in range(max(0, num_computed - window + 1), table_len * block_size)}


@pytest.mark.parametrize("window,block_size,chunk", [(3, 4, 5), (8, 4, 3), (9, 2, 16), (1, 4, 4)])
def test_window_tables_keep_exactly_the_visible_blocks(window: int, block_size: int, chunk: int) -> None:
    """Two requests through the scheduler (chunked prefill, then decode): after every trim the
    window group holds the blocks some future query can see and no other, while the full group
    holds them all; everything returns to the pool at the end."""
    bm = BlockManager(200, block_size, False, windows=(None, window))
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=chunk)
    rng = random.Random(window)
    seqs = [_seq(i, [rng.randrange(50) for _ in range(n)]) for i, n in enumerate((23, 14))]
    for seq in seqs:
        sched.add(seq)
    bound = max_request_blocks((window,), block_size, 10**6, chunk)
    for _ in range(40):
        for seq in sched.running:
            bm.trim(seq)
            full, windowed = seq.block_tables
            assert NULL_BLOCK not in full
            real = {i for i, b in enumerate(windowed) if b != NULL_BLOCK}
            assert real == _needed_blocks(seq.num_computed, window, block_size, len(windowed))
        chunks = sched.schedule()
        for c in chunks:
            windowed = c.seq.block_tables[1]
            assert sum(b != NULL_BLOCK for b in windowed) <= bound
            c.seq.num_computed += c.num_tokens
            if c.samples:
                c.seq.token_ids.append(rng.randrange(50))
        if all(s.num_tokens >= s.prompt_len + 6 for s in seqs):
            break
    decoding = seqs[0]
    bm.trim(decoding)
    assert sum(b != NULL_BLOCK for b in decoding.block_tables[1]) <= -(-window // block_size) + 1
    for seq in list(sched.running):
        sched.finish(seq, "length")
    assert bm.num_free == bm.num_usable == 199


def _prefill(bm: BlockManager, seq: Sequence) -> None:
    bm.admit(seq, bm.match_prefix(seq))
    bm.grow(seq, seq.num_tokens)
    seq.num_computed = seq.num_tokens
    bm.commit(seq)


def test_a_prefix_hit_needs_every_group_and_only_the_window_blocks_of_a_window_group() -> None:
    bm = BlockManager(40, 4, True, windows=(None, 6))  # 39 usable blocks, 0 is the null block
    a = _seq(0, list(range(30)))
    _prefill(bm, a)
    window_blocks = list(a.block_tables[1])
    bm.trim(a)  # the next query (position 30) sees 25..30: blocks 0..5 go back to the pool
    assert a.block_tables[1] == [NULL_BLOCK] * 6 + window_blocks[6:]
    assert bm.num_free == 39 - 10
    other = _seq(1, [90 + i for i in range(56)])  # 14 blocks per group: the 23 never used, then
    _prefill(bm, other)  # the 5 least recently freed (a's window blocks 0..4) are reused
    b = _seq(2, list(range(30)) + [7])
    full, windowed = bm.match_prefix(b)
    # 7 blocks (28 tokens) cached; a query at 28 sees 23..28: the window group needs blocks 5, 6 only
    assert full == a.block_tables[0][:7]
    assert windowed == [NULL_BLOCK] * 5 + window_blocks[5:7]
    assert bm.num_free == 1 and not bm.can_admit(3, [full, windowed])  # that one is the hit itself
    bm.release(other)
    assert bm.can_admit(3, [full, windowed])
    spill = _seq(3, [1])
    bm.grow(spill, 1)  # takes the least recently freed block: a's old window block 5
    assert window_blocks[5] in spill.block_tables[0] + spill.block_tables[1]
    assert bm.match_prefix(b) == [[], []]  # the full group still has the prefix, the window group not
    bm.admit(b, [[], []])
    assert b.num_computed == 0 and b.block_tables == [[], []]

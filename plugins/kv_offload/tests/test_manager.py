"""The CPU tier's manager (vLLM's OffloadingManager semantics) with LRU and ARC, as tables:
each row is an operation and the state it must leave."""

from __future__ import annotations

import random

import pytest
from jackfield_kv_offload.keys import ChunkKey
from jackfield_kv_offload.manager import OffloadManager
from jackfield_kv_offload.policies import ARCPolicy, LRUPolicy, make_policy


def keys(*names: int, group: int = 0) -> list[ChunkKey]:
    return [ChunkKey(group, n) for n in names]


def stored(manager: OffloadManager, *names: int) -> None:
    plan = manager.prepare_store(keys(*names))
    assert plan is not None
    manager.complete_store(plan.keys, True)


def order(manager: OffloadManager) -> list[int]:
    return [k.block_hash for k in manager.policy.order()]


def test_lookup_counts_ready_chunks_from_the_start() -> None:
    m = OffloadManager(8, LRUPolicy())
    stored(m, 1, 2, 3)
    plan = m.prepare_store(keys(4))
    assert plan is not None
    table = [((1, 2, 3), 3), ((1, 2, 3, 4), 3), ((2, 3), 2), ((1, 9, 3), 1), ((9, 1), 0), ((4,), 0)]
    for names, hits in table:
        assert m.lookup(keys(*names)) == hits, names
    m.complete_store(plan.keys, True)
    assert m.lookup(keys(1, 2, 3, 4)) == 4


def test_group_is_part_of_the_key() -> None:
    m = OffloadManager(4, LRUPolicy())
    stored(m, 1, 2)
    assert m.lookup(keys(1, 2, group=1)) == 0


# LRU with 4 slots: (operation, names, eviction order afterwards, chunks the store writes)
LRU_TABLE = [
    ("store", (1, 2, 3), [1, 2, 3], (1, 2, 3)),
    ("touch", (1, 2), [3, 2, 1], None),  # reverse order: the prefix start ends most recent
    ("touch", (3,), [2, 1, 3], None),
    ("store", (2, 4), [2, 1, 3, 4], (4,)),  # 2 is held: skipped, not moved
    ("store", (5,), [1, 3, 4, 5], (5,)),  # full: the least recent (2) goes
    ("touch", (4, 2), [1, 3, 5, 4], None),  # 2 is gone: touching it changes nothing
    ("store", (6, 7), [5, 4, 6, 7], (6, 7)),  # 1 and 3 go
    ("store", (8, 9, 10, 11, 12), [5, 4, 6, 7], None),  # 5 new > 4 slots: nothing changes
    ("store", (5, 13), [5, 6, 7, 13], (13,)),  # 5 is least recent but being stored: 4 goes
]


def test_lru_table() -> None:
    m = OffloadManager(4, LRUPolicy())
    for i, (op, names, expected_order, written) in enumerate(LRU_TABLE):
        if op == "touch":
            m.touch(keys(*names))
        else:
            plan = m.prepare_store(keys(*names))
            assert (plan.keys if plan else None) == (written and tuple(keys(*written))), i
            if plan:
                m.complete_store(plan.keys, True)
        assert order(m) == expected_order, i


def test_store_is_all_or_nothing_and_skips_held_chunks() -> None:
    m = OffloadManager(3, LRUPolicy())
    stored(m, 1, 2)
    slots = m.prepare_load(keys(1))  # 1 is being loaded: not evictable
    assert len(slots) == 1
    assert m.prepare_store(keys(3, 4, 5)) is None  # needs 2 evictions, only 2 is evictable
    assert order(m) == [1, 2] and m.lookup(keys(1, 2)) == 2 and len(m.free_slots) == 1
    plan = m.prepare_store(keys(1, 3, 4))  # 1 held (skipped); 3 fills the free slot, 4 evicts 2
    assert plan is not None and plan.keys == tuple(keys(3, 4)) and plan.evicted == tuple(keys(2))
    m.complete_load(keys(1))
    with pytest.raises(ValueError):
        m.complete_load(keys(1))


def test_chunks_not_yet_stored_are_neither_found_nor_evicted() -> None:
    m = OffloadManager(2, LRUPolicy())
    pending = m.prepare_store(keys(1, 2))
    assert pending is not None and m.lookup(keys(1)) == 0
    with pytest.raises(KeyError):
        m.prepare_load(keys(1))
    assert m.prepare_store(keys(3)) is None  # 1 and 2 are in flight: nothing to evict
    m.complete_store(keys(1), True)
    m.complete_store(keys(2), False)  # a failed store frees its slot and is forgotten
    assert m.lookup(keys(1, 2)) == 1 and order(m) == [1] and len(m.free_slots) == 1
    m.complete_store(keys(1), False)  # already ready: a late failure report changes nothing
    assert m.lookup(keys(1)) == 1


def test_eviction_under_pressure_never_drops_loading_or_unstored_chunks() -> None:
    seed = 20
    print(f"seed={seed}")
    rng = random.Random(seed)
    for policy in ("lru", "arc"):
        m = OffloadManager(6, make_policy(policy, 6))
        loading: dict[ChunkKey, int] = {}
        pending: set[ChunkKey] = set()
        for _ in range(2000):
            op = rng.random()
            names = keys(*rng.sample(range(30), rng.randint(1, 3)))
            if op < 0.4:
                before = dict(m.chunks)
                plan = m.prepare_store(names)
                if plan is None:
                    assert m.chunks == before
                    continue
                assert not (set(plan.evicted) & (set(loading) | pending))
                pending |= set(plan.keys)
            elif op < 0.6 and pending:
                done = rng.sample(sorted(pending, key=lambda k: k.block_hash), 1)
                m.complete_store(done, rng.random() < 0.8)
                pending -= set(done)
            elif op < 0.8:
                hits = m.lookup(names)
                if hits:
                    m.prepare_load(names[:hits])
                    for k in names[:hits]:
                        loading[k] = loading.get(k, 0) + 1
            elif loading:
                k = rng.choice(sorted(loading, key=lambda k: k.block_hash))
                m.complete_load([k])
                loading[k] -= 1
                if not loading[k]:
                    del loading[k]
            m.touch(names)
            assert all(k in m.chunks and m.chunks[k].ready for k in loading)
            assert all(k in m.chunks and not m.chunks[k].ready for k in pending)
            slots = [c.slot for c in m.chunks.values()] + m.free_slots
            assert sorted(slots) == list(range(6))  # every slot exactly once


# ARC with capacity 4: (operation, names, T1, T2, B1, B2, target after)
ARC_TABLE = [
    ("store", (1, 2, 3, 4), [1, 2, 3, 4], [], [], [], 0.0),
    ("touch", (1,), [2, 3, 4], [1], [], [], 0.0),  # a second use promotes to T2
    ("store", (5,), [3, 4, 5], [1], [2], [], 0.0),  # |T1| = 3 >= target 0: evict T1's oldest
    ("touch", (2,), [3, 4, 5], [1], [2], [], 1.0),  # B1 ghost hit: target + max(1, 0/1)
    ("store", (2,), [4, 5], [1, 2], [3], [], 1.0),  # a stored ghost returns to T2; 3 evicted
    ("touch", (4, 5), [], [1, 2, 5, 4], [3], [], 1.0),
    ("store", (6,), [6], [2, 5, 4], [3], [1], 1.0),  # |T1| = 0 < 1: evict T2's oldest (1)
    ("touch", (1,), [6], [2, 5, 4], [3], [1], 0.0),  # B2 hit: target - max(1, |B1|/|B2|)
]


def test_arc_table() -> None:
    m = OffloadManager(4, ARCPolicy(4))
    arc = m.policy
    assert isinstance(arc, ARCPolicy)
    for i, (op, names, t1, t2, b1, b2, target) in enumerate(ARC_TABLE):
        if op == "touch":
            m.touch(keys(*names))
        else:
            stored(m, *names)
        state = [[k.block_hash for k in lst] for lst in (arc.t1, arc.t2, arc.b1, arc.b2)]
        assert state == [t1, t2, b1, b2], (i, state)
        assert arc.target_t1 == target, i


def test_arc_target_moves_by_the_ghost_ratio_and_ghosts_are_trimmed() -> None:
    arc = ARCPolicy(2)
    for n in range(6):
        arc.insert(n)
    assert arc.evict(4, lambda k: True) == [0, 1, 2, 3]
    assert list(arc.b1) == [2, 3]  # trimmed to the capacity
    arc.b2.update({10: None, 11: None, 12: None, 13: None})  # |B2| / |B1| = 2
    arc.touch(2, ready=False)
    assert arc.target_t1 == 2.0  # min(0 + 2, capacity 2)
    arc.touch(10, ready=False)  # B2 hit: - max(1, 2/4)
    assert arc.target_t1 == 1.0


def test_arc_evicts_from_t2_when_t1_is_below_target_and_falls_back() -> None:
    arc = ARCPolicy(4)
    arc.t1.update({1: None})
    arc.t2.update({2: None, 3: None})
    arc.target_t1 = 3.0
    assert arc.evict(1, lambda k: True) == [2]  # |T1| = 1 < 3: T2's oldest
    assert arc.evict(1, lambda k: k != 3) == [1]  # T2 has nothing evictable: T1 instead
    assert arc.evict(1, lambda k: k != 3) is None and list(arc.t2) == [3]


def test_policy_names() -> None:
    assert isinstance(make_policy("lru", 4), LRUPolicy)
    assert isinstance(make_policy("arc", 4), ARCPolicy)
    with pytest.raises(ValueError, match="lru"):
        make_policy("fifo", 4)

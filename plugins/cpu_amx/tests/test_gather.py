"""The gather layout and the block gather: a bit-exact copy of the planned blocks, whatever their widths."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from jackfield.testing.problems import mla_layer
from jackfield_cpu_amx.kernels import gather_group_cache
from jackfield_cpu_amx.plan import PLANS_KEY, CpuAmxMetadataBuilder, Scratch, plan_key
from jackfield_cpu_amx.testing import make_problem


@pytest.mark.parametrize(
    "block_size,kv_lora_rank,rope,dtype",
    [
        (512, 512, 64, torch.bfloat16),  # 576 KiB blocks: split into rows short enough to memcpy
        (5, 4, 2, torch.bfloat16),  # 12-byte records: 4-byte integer rows
        (8, 64, 16, torch.float32),
    ],
)
def test_gather_copies_the_planned_blocks_bit_exactly(block_size, kv_lora_rank, rope, dtype) -> None:
    layer = mla_layer(num_heads=2, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope)
    problem = make_problem(layer, [1, 1], [block_size + 3, 2 * block_size], block_size, dtype, seed=4)
    md = CpuAmxMetadataBuilder(1 << 20, block_size).build(problem.metadata)
    (group,) = md.extra[PLANS_KEY][plan_key(md)].groups
    chunks = group.key_chunks(block_size)
    scratch = Scratch()
    for bits in (torch.int16, torch.int32, torch.int64):
        scratch.get(bits, 1 << 20).fill_(-1)  # all ones: NaN as any float; the gather must overwrite it
    got = gather_group_cache(problem.kv_cache, group, chunks, dtype, scratch)
    want = problem.kv_cache[chunks.block_ids].view(group.num_reqs, -1, problem.kv_cache.shape[-1]).clone()
    want.view(-1, want.shape[-1])[chunks.stale_rows] = 0
    assert chunks.stale_rows.numel() > 0 and torch.equal(got.view(torch.int8), want.view(torch.int8))


@pytest.mark.parametrize(
    "num_reqs,seq_len,threads,num_chunks",
    [
        (1, 4096, 2, 2),  # one request: a chunk per thread
        (16, 4096, 16, 1),  # a request per thread: no split, no merge
        (2, 300, 16, 2),  # short: chunks of at least MIN_CHUNK_KEYS (256 keys: 4 whole blocks)
        (16, 4095, 16, 1),  # lengths off a block multiple: still one task per thread
        (1, 4100, 16, 13),  # 257 keys a task, rounded up to 5 blocks: 13 tasks, not 17
        (1, 100, 1, 1),
    ],
)
def test_chunks_by_thread_count(monkeypatch, num_reqs, seq_len, threads, num_chunks) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    problem = make_problem(mla_layer(num_heads=2), [1] * num_reqs, [seq_len] * num_reqs, 64, torch.float32)
    md = CpuAmxMetadataBuilder(group_keys=1 << 20).build(problem.metadata)
    (group,) = md.extra[PLANS_KEY][plan_key(md)].groups
    assert group.key_chunks(64).num_chunks == num_chunks


def test_a_plan_whose_groups_miss_query_rows_is_rejected() -> None:
    """attend() writes its outputs only through the groups (it does not poison them first), so a
    plan must tile the query rows: a dropped group, or groups out of place, fail at construction."""
    problem = make_problem(mla_layer(num_heads=4), [1, 1, 3, 2], [9, 14, 6, 8], 4, torch.float32, seed=5)
    built = CpuAmxMetadataBuilder(group_keys=1).build(problem.metadata)
    plan = built.extra[PLANS_KEY][plan_key(built)]
    assert len(plan.groups) == 4  # one request each: every later group starts where the last ended
    with pytest.raises(ValueError, match="query row"):
        replace(plan, groups=plan.groups[:-1])
    with pytest.raises(ValueError, match="query row"):
        replace(plan, groups=plan.groups[1:])
    with pytest.raises(ValueError, match="query row"):
        replace(plan, groups=(plan.groups[1], plan.groups[0], *plan.groups[2:]))

"""The block tables' host array (BlockTableRows) against the lists the block manager keeps, and a
step's slots and tables (eager metadata and the CUDA-graph buffers) against the lists'."""

from __future__ import annotations

import random

import torch
from jackfield import LLM, SamplingParams
from jackfield.engine.block_manager import BlockManager
from jackfield.engine.block_table import BlockTableRows, slots_at
from jackfield.engine.scheduler import Scheduler
from jackfield.engine.sequence import Sequence, Status


def assert_rows_mirror_lists(rows: BlockTableRows, seqs: list[Sequence]) -> None:
    """Every request holding blocks has a row of its own equal to its lists, 0 past them, and
    every other row is free and all 0."""
    holding = [s for s in seqs if s.block_tables]
    assert all(s.table_row is None for s in seqs if not s.block_tables)
    taken = [s.table_row for s in holding]
    assert len(set(taken)) == len(taken) and not set(taken) & set(rows.free_rows)
    for seq in holding:
        assert len({len(table) for table in seq.block_tables}) == 1, "every group's table has one length"
        length = len(seq.block_tables[0])
        assert rows.lengths[seq.table_row] == length  # type: ignore[index]
        assert rows.array[:, seq.table_row, :length].tolist() == seq.block_tables
        assert not rows.array[:, seq.table_row, length:].any()
    for row in rows.free_rows:
        assert rows.lengths[row] == 0 and not rows.array[:, row].any()
    if holding:
        width = max(len(s.block_tables[0]) for s in holding)
        want = [[table + [0] * (width - len(table)) for table in (s.block_tables[g] for s in holding)]
                for g in range(rows.array.shape[0])]
        assert rows.gather(taken).tolist() == want  # type: ignore[arg-type]
        assert rows.gather_array(taken).tolist() == want  # type: ignore[arg-type]  # the graphs' fills


def test_rows_follow_random_admits_decodes_windows_preemptions_and_finishes(rng_seed: int) -> None:
    """A scheduler over a small pool (preemptions), prefix caching over shared prompt heads
    (prefix hits), a window group (dropped blocks), chunked prefill, finishes and aborts; the
    array starts at one row and one column, so it grows in both."""
    print(f"seed {rng_seed}")
    rng = random.Random(rng_seed)
    rows = BlockTableRows(3, rows=1, width=1)
    blocks = BlockManager(num_blocks=40, block_size=4, enable_prefix_caching=True, windows=(None, 6, 6),
                          table_rows=rows)
    scheduler = Scheduler(blocks, max_num_seqs=6, max_num_batched_tokens=24)
    heads = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    seqs: list[Sequence] = []
    for _ in range(300):
        if rng.random() < 0.3 and len(seqs) < 60:
            tail = [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
            prompt = rng.choice(heads)[: rng.randrange(13)] + tail
            seq = Sequence(len(seqs), len(prompt), prompt, SamplingParams(max_tokens=rng.randrange(1, 30)), 0)
            seqs.append(seq)
            scheduler.add(seq)
        if rng.random() < 0.03 and (live := [s for s in seqs if s.status != Status.FINISHED]):
            scheduler.abort(rng.choice(live))
        for chunk in scheduler.schedule():
            seq = chunk.seq
            seq.num_computed += chunk.num_tokens
            if chunk.samples:
                seq.token_ids.append(rng.randrange(50))
            blocks.commit(seq)
            if seq.num_tokens - seq.prompt_len >= seq.params.max_tokens:
                scheduler.finish(seq, "length")
        assert_rows_mirror_lists(rows, seqs)
    assert scheduler.num_preemptions and any(s.num_cached_prefix for s in seqs)
    assert rows.array.shape[1] > 1 and rows.array.shape[2] > 1


def test_a_step_reads_slots_and_tables_as_the_lists_give_them(tmp_path, rng_seed: int) -> None:
    """Granite SWA (a full group beside window groups, blocks of 4) through chunked prefills mixed
    with decodes past the window: each step's eager metadata and the decode graphs' buffers hold
    the block tables and slots (slot = table[p // 4] * 4 + p % 4) computed from the lists. (The
    capture's fill of no rows leaves every slot -1.)"""
    from jackfield.engine.cuda_graphs import DecodeGraphs
    from jackfield.testing.checkpoints import write_granite

    write_granite("granite_swa", tmp_path / "swa")
    llm = LLM(str(tmp_path / "swa"), device="cpu", backend="torch_ref", block_size=4, max_num_seqs=8,
              max_num_batched_tokens=16)
    engine, runner = llm.engine, llm.engine.runner
    graphs = DecodeGraphs(engine.model, runner.kv_caches, runner.kv_scales, runner.contexts,
                          runner.block_tables, runner.kv.num_blocks, runner.block_size,
                          engine.max_model_len, 8, engine.device)
    assert graphs._fill([], 8, 1) == 0  # what capture records: rows that see no KV and write none
    assert all((slots.gpu[:8] == -1).all() for slots in graphs.slot_mapping)
    assert not graphs.seq_lens.gpu[:8].any()
    g = torch.Generator().manual_seed(rng_seed)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 9, 14, 21)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_requests([(p, params) for p in prompts])
    checked = {"eager": 0, "graph": 0}
    eager_step = runner.step

    def check_then_step(chunks, metadata=None):  # type: ignore[no-untyped-def]
        per_group, _, _ = runner._metadata(chunks)
        for group, md in enumerate(per_group):
            tables = [c.seq.block_tables[group] for c in chunks]
            width = max(len(t) for t in tables)
            assert md.block_table.tolist() == [t + [0] * (width - len(t)) for t in tables]
            slots = [t[p // 4] * 4 + p % 4 for c, t in zip(chunks, tables, strict=True)
                     for p in range(c.seq.num_computed, c.seq.num_computed + c.num_tokens)]
            assert md.slot_mapping.tolist() == slots
            if graphs.query_len(chunks) == 1:
                size = next(s for s in graphs.sizes if s >= len(chunks))
                graphs._fill(chunks, size, 1)
                assert graphs.slot_mapping[group].gpu[:size].tolist() == slots + [-1] * (size - len(chunks))
                for row, table in enumerate(tables):
                    assert graphs.block_table[group].gpu[row, : len(table)].tolist() == table
                checked["graph"] += 1
        checked["eager"] += 1
        return eager_step(chunks, metadata)

    runner.step = check_then_step
    while engine.scheduler.has_work():
        engine.step()
    assert checked["eager"] > 10 and checked["graph"] > 10


def test_slots_at_are_the_lists_slots(rng_seed: int) -> None:
    """Each position's slot is block table[position // block size] * block size + position %
    block size, per request, for positions [n, ...] of any rank (a decode's rows, a chain's rows
    at every accepted count)."""
    print(f"seed {rng_seed}")
    rng = random.Random(rng_seed)
    bs, n, width = 4, 3, 5
    lists = [[rng.randrange(1, 100) for _ in range(width)] for _ in range(n)]
    positions = torch.randint(0, bs * width, (n, 2, 3)).numpy()
    got = slots_at(torch.tensor(lists, dtype=torch.int32).numpy(), positions, bs)
    want = [[[lists[r][p // bs] * bs + p % bs for p in row] for row in request]
            for r, request in enumerate(positions.tolist())]
    assert got.tolist() == want

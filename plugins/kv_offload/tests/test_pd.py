"""The pd connector without engines: a producer process (pd_side.py) sends one prompt's blocks, this
process receives and loads them. Which blocks must move is derived here from token positions (a
window group's query at the resume point R sees keys (R - W, R]), not from the connector's chunk
arithmetic; the bytes are compared with the producer's own cache."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from jackfield.commands.pd import free_address
from jackfield.contracts.kv_connector import ConnectorRequest, KVCoverageSpec, ScheduledRequest
from jackfield_kv_offload.keys import group_chunkings
from jackfield_kv_offload.options import check_pd_options
from jackfield_kv_offload.pd import make_pd
from jackfield_kv_offload.pd_producer import PDProducerScheduler

SIDE = Path(__file__).with_name("pd_side.py")
_spec = importlib.util.spec_from_file_location("pd_side", SIDE)
assert _spec is not None and _spec.loader is not None
side = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(side)
RESUME = side.PROMPT // side.BLOCK * side.BLOCK  # where the consumer's request resumes


def start_producer(kind: str, address: str, seed: int, die_after: int | None = None) -> subprocess.Popen:
    extra = [] if die_after is None else [str(die_after)]
    return subprocess.Popen([sys.executable, str(SIDE), kind, address, str(seed), *extra])


def needed_blocks(window: int | None) -> list[int]:
    """Blocks holding the keys a query at RESUME (and later) sees: all before it, or the window's."""
    first = 0 if window is None else max(0, RESUME - (window - 1))
    return sorted({p // side.BLOCK for p in range(first, RESUME)})


def consumer_tables(groups: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """The decode engine's blocks for 24 tokens (6 per group), scattered, disjoint across groups."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(side.NUM_BLOCKS - 1, generator=g)[: 6 * groups] + 1  # block 0 is never handed out
    return tuple(tuple(order[6 * g : 6 * g + 6].tolist()) for g in range(groups))


def first_token_request(request_id: str, seed: int) -> ConnectorRequest:
    """The consumer's request: the prompt and its first token."""
    return ConnectorRequest(request_id, side.hashes(seed)[: (side.PROMPT + 1) // side.BLOCK], side.PROMPT + 1)


def load(scheduler, worker, ctx, request: ConnectorRequest, tables, timeout_s: float):  # noqa: ANN001, ANN201
    """Admit `request` with the producer's blocks expected, then step the connector until its
    load ends; returns (TransferResult, seconds waited)."""
    assert scheduler.get_num_new_matched_tokens(request, 0) == (RESUME, True)  # async
    scheduler.update_state_after_alloc(request, tables, 0, RESUME)
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        metadata = scheduler.build_connector_meta([])
        worker.start_load_kv(metadata, ctx.kv_caches)
        result = worker.get_finished()
        scheduler.update_connector_output(result)
        if request.request_id in result.loaded | result.failed_loads:
            return result, time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"the load of {request.request_id} did not end within {timeout_s} s")


@pytest.mark.parametrize("kind", ["mla", "mha"])
def test_a_prompts_blocks_arrive_byte_exact(kind: str) -> None:
    seed = 41
    print(f"seed={seed}")
    address = free_address()
    producer = start_producer(kind, address, seed)
    try:
        ctx = side.context(kind, "consumer", address, seed + 100)  # other random bytes
        scheduler, worker = make_pd(ctx)
        sent = side.context(kind, "producer", address, seed)  # the producer's bytes (no connection)
        before = [t.clone() for t in ctx.kv_caches[:2]]
        request = first_token_request(side.REQUEST, seed)
        tables = consumer_tables(len(ctx.coverage), seed)
        result, _ = load(scheduler, worker, ctx, request, tables, timeout_s=30)
        assert result.loaded == {side.REQUEST} and not result.failed_loads
        written = set()
        for layer, group in enumerate(ctx.layer_group):
            blocks = needed_blocks(ctx.coverage[group].sliding_window)
            for b in blocks:
                source = side.producer_tables(len(ctx.coverage))[group][b]
                assert torch.equal(side.block_bytes(ctx, layer, tables[group][b]),
                                   side.block_bytes(sent, layer, source)), (layer, b)
                written.add((layer % 2, tables[group][b]))
        for j, old in enumerate(before):  # nothing else in the cache moved (layer j uses tensor j)
            for b in range(side.NUM_BLOCKS):
                if (j, b) not in written:
                    assert torch.equal(side.block_bytes(ctx, j, b), side.block_bytes(ctx, j, b, old))
        stats = scheduler.stats()
        expected_blocks = sum(len(needed_blocks(c.sliding_window)) for c in ctx.coverage)
        assert stats["received_chunks"] == stats["loaded_chunks"] == expected_blocks
        assert stats["hit_tokens"] == RESUME
    finally:
        assert producer.wait(timeout=60) == 0


def test_a_producer_killed_mid_transfer_fails_the_load_in_time_and_writes_nothing() -> None:
    seed, timeout_s = 43, 2.0
    print(f"seed={seed}")
    address = free_address()
    producer = start_producer("mha", address, seed, die_after=1)  # BEGIN, one layer of four, then dead
    try:
        ctx = side.context("mha", "consumer", address, seed + 100, timeout_s=timeout_s)
        scheduler, worker = make_pd(ctx)
        before = [t.clone() for t in ctx.kv_caches[:2]]
        request = first_token_request(side.REQUEST, seed)
        result, waited = load(scheduler, worker, ctx, request, consumer_tables(2, seed), timeout_s=30)
        assert result.failed_loads == {side.REQUEST} and not result.loaded
        assert waited < 3 * timeout_s  # the stream's timeout or the load's deadline, whichever first
        assert all(torch.equal(t.view(torch.uint8), old.view(torch.uint8))  # bytes: random floats hold NaNs
                   for t, old in zip(ctx.kv_caches[:2], before, strict=True))
        stats = scheduler.stats()
        assert stats["cpu_chunks_held"] == 0 and stats["aborted_transfers"] == 1
        # the stream is gone: a later request expects nothing and loads nothing
        later = ConnectorRequest("8", request.block_hashes, request.num_tokens)
        assert scheduler.get_num_new_matched_tokens(later, 0)[0] == 0
    finally:
        assert producer.wait(timeout=60) == 3


def test_a_consumer_with_another_layout_refuses_at_start_up() -> None:
    address = free_address()
    producer = start_producer("mla", address, 1)
    try:
        with pytest.raises(ValueError, match="KV cache layout .* differs"):
            make_pd(side.context("mha", "consumer", address, 2))
    finally:
        assert producer.wait(timeout=60) != 0  # the producer refuses too


def test_the_producer_exports_each_reachable_block_once_over_a_chunked_prefill() -> None:
    """A 23-token prompt prefilled in chunks of 7, 7, 9 tokens: each step exports the blocks it
    completed that the resume point reaches, never past num_exportable (drafts) and never twice."""
    window, lookahead = 6, 2
    coverage = (KVCoverageSpec(side.BLOCK), KVCoverageSpec(side.BLOCK, window))
    scheduler = PDProducerScheduler(group_chunkings(coverage, [1, 1], lookahead))
    hashes = side.hashes(5)[:5]
    request = ConnectorRequest("3", hashes, side.PROMPT)
    tables = side.producer_tables(2)
    scheduler.update_state_after_alloc(request, tables, 0, 0)
    exported: list[tuple[int, int]] = []  # (group, block id)
    for computed in (7, 14, 23, 23 + lookahead):  # the last: a step whose extra KV is draft only
        exportable = min(computed, side.PROMPT)
        metadata = scheduler.build_connector_meta([ScheduledRequest(request, tables, exportable)])
        export = metadata.payload["export"]
        if export is not None:
            offset = 0
            for key in export.keys:
                assert key.block_hash in hashes
            for group, blocks in enumerate(export.blocks):
                exported += [(group, b) for b in blocks]
                offset += len(blocks)
            assert offset == len(export.keys)
    # window 6 + 2 retained draft positions: keys (R - 8, R) = positions 12..19
    first_window = RESUME - (window - 1 + lookahead)
    expected = [(0, tables[0][b]) for b in range(RESUME // side.BLOCK)]
    expected += [(1, tables[1][b]) for b in sorted({p // side.BLOCK for p in range(first_window, RESUME)})]
    assert sorted(exported) == sorted(expected)


@pytest.mark.parametrize(("options", "field"), [
    ({"address": "127.0.0.1:1"}, "role"),
    ({"role": "prefill", "address": "127.0.0.1:1"}, "role"),
    ({"role": "producer"}, "address"),
    ({"role": "producer", "address": "localhost"}, "address"),
    ({"role": "producer", "address": "h:1", "timeout_s": 0}, "timeout_s"),
    ({"role": "producer", "address": "h:1", "connect_timeout_s": "long"}, "connect_timeout_s"),
    ({"role": "producer", "address": "h:1", "blocks_per_chunk": 2}, "blocks_per_chunk"),
])
def test_bad_options_name_their_field(options: dict[str, object], field: str) -> None:
    problems = check_pd_options(options)
    assert any(f"kv_connector.options.{field}" in p for p in problems), problems

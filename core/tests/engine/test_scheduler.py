from __future__ import annotations

from collections.abc import Sequence as Seq

import pytest
from jackfield import SamplingParams
from jackfield.contracts.kv_connector import (
    ConnectorMetadata,
    ConnectorRequest,
    KVConnectorScheduler,
    ScheduledRequest,
    TransferResult,
)
from jackfield.engine.block_manager import BlockManager
from jackfield.engine.scheduler import Scheduler
from jackfield.engine.sequence import Sequence, Status


def _seq(request_id: int, n: int) -> Sequence:
    return Sequence(request_id, n, list(range(100 * request_id, 100 * request_id + n)), SamplingParams(), 0)


def _advance(chunks) -> None:
    """Pretend the step ran: tokens computed, a token sampled where the chunk reached the end."""
    for c in chunks:
        samples = c.samples
        c.seq.num_computed += c.num_tokens
        if samples:
            c.seq.token_ids.append(1)


def test_token_budget_chunks_prefill_and_decodes_come_first() -> None:
    s = Scheduler(BlockManager(64, 4, False), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = _seq(1, 6), _seq(2, 12)
    s.add(a)
    s.add(b)
    step1 = s.schedule()
    assert [(c.seq, c.num_tokens) for c in step1] == [(a, 6), (b, 4)]
    _advance(step1)
    step2 = s.schedule()
    assert [(c.seq, c.num_tokens) for c in step2] == [(a, 1), (b, 8)]  # a decodes first, b continues
    assert step2[0].samples and step2[1].samples


def test_max_num_seqs_and_fcfs() -> None:
    s = Scheduler(BlockManager(64, 4, False), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [_seq(i + 1, 3) for i in range(3)]
    for seq in seqs:
        s.add(seq)
    assert [c.seq for c in s.schedule()] == seqs[:2]
    assert seqs[2].status is Status.WAITING


def test_preemption_frees_the_newest_and_requeues_it_first() -> None:
    s = Scheduler(BlockManager(4, 4, False), max_num_seqs=4, max_num_batched_tokens=100)
    a, b = _seq(1, 8), _seq(2, 8)
    s.add(a)
    s.add(b)
    _advance(s.schedule())  # both prompts: 4 blocks, pool empty
    step = s.schedule()  # a needs a 3rd block: b is preempted
    assert [c.seq for c in step] == [a]
    assert b.status is Status.WAITING and b.num_computed == 0 and b.block_table == []
    assert s.waiting[0] is b and s.num_preemptions == 1


def test_lookahead_is_reserved_for_running_requests_only_and_never_preempts() -> None:
    """A model drafter writes KV up to `lookahead` slots past a step's rows: a running request's
    blocks cover them where the pool has them, a request's first step (admission) never, and the
    reservation stops at its last position (max_tokens, max_model_len)."""
    bm = BlockManager(7, 4, False)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100, lookahead=3, max_model_len=64)
    a = Sequence(1, 5, list(range(5)), SamplingParams(max_tokens=5), 0)
    s.add(a)
    _advance(s.schedule())
    assert len(a.block_table) == 2  # the prompt's 5 slots only
    _advance(s.schedule())  # decode of position 5: slots 0..5 and 3 more -> 9 slots
    assert len(a.block_table) == 3
    _advance(s.schedule())
    assert len(a.block_table) == 3  # positions past prompt + max_tokens (10) are never reserved
    b = Sequence(2, 14, list(range(14)), SamplingParams(max_tokens=9), 0)
    s.add(b)
    _advance(s.schedule())  # b's prompt takes the last 4 blocks
    step = s.schedule()  # b's decode fits its 4 blocks; its lookahead would need a 5th: skipped
    assert [c.seq for c in step] == [a, b] and s.num_preemptions == 0
    assert len(b.block_table) == 4


class OfferingConnector(KVConnectorScheduler):
    """Offers the first `offer` tokens of every request longer than that, loaded asynchronously
    or in-step."""

    def __init__(self, offer: int, load_async: bool) -> None:
        self.offer, self.load_async = offer, load_async
        self.allocated: list[tuple[int, int]] = []  # (device hit, external) per admission

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed: int) -> tuple[int, bool]:
        offered = self.offer - num_computed if request.num_tokens > self.offer else 0
        return max(offered, 0), self.load_async

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Seq[Seq[int]],
                                 num_computed: int, num_external: int) -> None:
        self.allocated.append((num_computed, num_external))

    def build_connector_meta(self, scheduled: Seq[ScheduledRequest]) -> ConnectorMetadata:
        return ConnectorMetadata({})

    def update_connector_output(self, result: TransferResult) -> None:
        pass

    def request_finished(self, request_id: str, block_ids: Seq[Seq[int]]) -> bool:
        return False


@pytest.mark.parametrize("load_async", [True, False])
def test_a_connector_load_waits_or_runs_in_the_same_step(load_async: bool) -> None:
    """Async: the request waits (no budget) until the report names it loaded. In-step: the loaded
    tokens count as computed at once and the rest is scheduled in that step, outside the budget."""
    connector = OfferingConnector(offer=8, load_async=load_async)
    s = Scheduler(BlockManager(64, 4, False), max_num_seqs=8, max_num_batched_tokens=10, connector=connector)
    a, b = _seq(1, 14), _seq(2, 3)
    s.add(a)
    s.add(b)
    step = s.schedule()
    assert connector.allocated[0] == (0, 8)
    assert len(a.block_table) == (2 if load_async else 4)  # the loaded tokens' blocks (and the rest's)
    if load_async:
        assert [(c.seq, c.num_tokens) for c in step] == [(b, 3)] and a.status is Status.LOADING
        assert s.update_from_connector(TransferResult(loaded=frozenset({"1"}))) == set()
        assert a.num_computed == 8 and a.status is Status.RUNNING
    else:
        assert [(c.seq, c.num_tokens) for c in step] == [(a, 6), (b, 3)] and a.num_computed == 8
        assert step[0].samples  # its first token comes out of the loading step
        assert s.update_from_connector(TransferResult()) == set() and not s.loaded_in_step


def test_a_failed_in_step_load_sends_the_request_back_to_its_device_hit() -> None:
    connector = OfferingConnector(offer=8, load_async=False)
    s = Scheduler(BlockManager(64, 4, False), max_num_seqs=8, max_num_batched_tokens=100, connector=connector)
    a = _seq(1, 14)
    s.add(a)
    assert [(c.seq, c.num_tokens) for c in s.schedule()] == [(a, 6)]
    assert s.update_from_connector(TransferResult(failed_loads=frozenset({"1"}))) == {1}
    assert a.num_computed == 0 and a.status is Status.RUNNING and len(a.block_table) == 4
    assert [(c.seq, c.num_tokens) for c in s.schedule()] == [(a, 14)]  # recomputed, blocks kept

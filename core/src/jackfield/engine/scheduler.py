"""Continuous batching: a per-step token budget, chunked prefill, FCFS, preemption by recompute.

Each step first continues the running requests in admission order (decodes and unfinished
prefill chunks), then admits waiting requests while the budget, `max_num_seqs` and the block
pool allow. When a running request needs a block and none is free, the newest running request
is preempted: its blocks are released and it goes back to the front of the queue, to be
recomputed (prompt and generated tokens) later. Before any of that, running requests hand back
the sliding-window blocks their next queries no longer see.

With a KV connector, an admitted request whose prefix the connector can load past the device
prefix hit gets blocks for it. An asynchronous load waits in `loading` (taking no token budget)
until the connector's report says the load finished (it then resumes after the loaded tokens) or
failed (it recomputes them); the others run meanwhile. An in-step load counts its tokens as
computed at once and the request computes the rest in the same step (the worker loads each
layer's blocks before the layer reads them); if the report read right after that step names the
load failed, the engine drops the request's step and it recomputes from its device hit. A
finished request's blocks stay held while the connector still reads them.

A model drafter writes KV past a step's rows (its draft rows); a running request's blocks then
also cover `lookahead` slots past them where the pool has them (never at the cost of another
request, and never for a request's first step, the P/D rule: a remote prefill allocates the
prompt's blocks only); the drafter drafts no further than its blocks reach.

Under async scheduling (engine.py) a decoding request may have its previous token in flight: it is
counted as known (`Sequence.num_tokens_ahead`), so the request decodes its next position, unless
that token is its last by max_tokens or max_model_len (then it waits for its read-back and finish).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from jackfield.contracts.drafter import exportable_tokens
from jackfield.contracts.kv_connector import (
    ConnectorRequest,
    KVConnectorScheduler,
    ScheduledRequest,
    TransferResult,
)
from jackfield.engine.block_manager import BlockManager
from jackfield.engine.sequence import Sequence, Status


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # query rows this step, from seq.num_computed on (drafts included)
    num_drafts: int = 0  # the last rows are seq.draft_ids[:num_drafts], verified this step
    # The chunk reaches the end of the known tokens, so the step samples the next one: set when
    # the chunk is made (the step's update moves num_computed on; readers ask several times a step).
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        reaches = self.seq.num_computed + self.num_tokens - self.num_drafts == self.seq.num_tokens_ahead
        object.__setattr__(self, "samples", reaches)  # frozen: set once, here

    @property
    def prompt_logprob_positions(self) -> range:
        """Positions of this chunk whose output scores the next prompt token (prompt_logprobs)."""
        seq = self.seq
        if seq.params.prompt_logprobs is None or seq.pooling is not None:
            return range(0)
        return range(seq.num_computed, min(seq.num_computed + self.num_tokens, seq.prompt_len - 1))

    @property
    def input_ids(self) -> list[int]:
        """The chunk's query tokens: its known tokens, then its drafts. A token still in flight
        (async scheduling: the previous step's, not read back yet) is a 0 here; the step writes
        it on the device from the previous step's sampled tokens (`InFlightIds`)."""
        seq, start, known = self.seq, self.seq.num_computed, self.num_tokens - self.num_drafts
        ids = seq.token_ids[start : start + known]
        return ids + [0] * (known - len(ids)) + seq.draft_ids[: self.num_drafts]

    @property
    def is_decode(self) -> bool:
        """One known token (and its drafts): the attention backends' decode role serves it."""
        return self.num_tokens - self.num_drafts == 1


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 connector: KVConnectorScheduler | None = None, lookahead: int = 0,
                 max_model_len: int | None = None) -> None:
        """lookahead: KV slots a drafter may write past a step's rows (`combined_lookahead`), never
        reserved beyond a request's last position (max_tokens, max_model_len)."""
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.connector = connector
        self.lookahead, self.max_model_len = lookahead, max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []  # admitted, their prefix's KV coming from the connector
        # admitted this step with an in-step load: (request, tokens loaded, counted as computed)
        self.loaded_in_step: list[tuple[Sequence, int]] = []
        self.held: dict[str, Sequence] = {}  # finished or aborted, blocks kept while the connector reads them
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def connector_request(self, seq: Sequence) -> ConnectorRequest:
        num_blocks = seq.num_tokens // self.blocks.block_size
        return ConnectorRequest(str(seq.request_id), tuple(self.blocks.block_hashes(seq, num_blocks)),
                                seq.num_tokens)

    def scheduled_requests(self, chunks: list[ScheduledChunk]) -> list[ScheduledRequest]:
        """The step's requests as the connector sees them (embedding requests never reach it)."""
        return [ScheduledRequest(self.connector_request(c.seq), tuple(map(tuple, c.seq.block_tables)),
                                 exportable_tokens(c.seq.num_computed + c.num_tokens, c.num_drafts,
                                                   c.seq.num_tokens))
                for c in chunks if c.seq.pooling is None]

    def update_from_connector(self, result: TransferResult) -> set[int]:
        """The worker's report: loaded requests resume after their loaded tokens, failed loads
        recompute them (the blocks are overwritten, never read), held blocks are freed. Read right
        after a step with in-step loads, it returns the ids of the requests whose in-step load
        failed: their step read invalid blocks, so the engine drops its output, and they compute
        again from their device prefix hit."""
        assert self.connector is not None
        self.connector.update_connector_output(result)
        failed_in_step: set[int] = set()
        for seq, loaded in self.loaded_in_step:
            if str(seq.request_id) in result.failed_loads:
                seq.num_computed -= loaded
                failed_in_step.add(seq.request_id)
            else:  # as below: window blocks before the loaded window go before the commit
                self.blocks.trim(seq)
        self.loaded_in_step = []
        for seq in list(self.loading):
            rid = str(seq.request_id)
            if rid not in result.loaded and rid not in result.failed_loads:
                continue
            self.loading.remove(seq)
            if rid in result.loaded and rid not in result.failed_loads:
                seq.num_computed += seq.num_loading
                # Window blocks before the loaded window hold nothing: drop them before the
                # loaded blocks join the prefix cache.
                self.blocks.trim(seq)
                self.blocks.commit(seq)
            seq.num_loading = 0
            if seq.status == Status.LOADING:
                seq.status = Status.RUNNING
                self.running.append(seq)
            else:  # aborted while loading: its blocks were kept for the transfer's end
                self._release(seq)
        for rid in result.saved | result.failed_saves:
            held = self.held.pop(rid, None)
            if held is not None:
                self.blocks.release(held)
        return failed_in_step

    def schedule(self) -> list[ScheduledChunk]:
        """This step's chunks, single-token chunks (decodes) first."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        for seq in self.running:
            self.blocks.trim(seq)
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.num_in_flight and self._ends_in_flight(seq):
                index += 1
                continue
            count = min(seq.num_uncomputed, budget)
            # A decode verifies its drafts when all of them fit the budget (their KV slots are
            # reserved with the rest; rejected ones are overwritten later), else decodes plainly.
            drafts = len(seq.draft_ids)
            drafts = drafts if count == seq.num_uncomputed == 1 <= budget - drafts else 0
            count += drafts
            if drafts and not self.blocks.can_grow(seq, seq.num_computed + count):
                count, drafts = count - drafts, 0  # drafts never preempt another request
            while not self.blocks.can_grow(seq, seq.num_computed + count):
                self._preempt(self.running[-1])
                preempted = True
                if index >= len(self.running) or self.running[index] is not seq:
                    break  # seq itself was the newest: it waits now
            else:
                self.blocks.grow(seq, self._with_lookahead(seq, seq.num_computed + count))
                chunks.append(ScheduledChunk(seq, count, drafts))
                budget -= count
                index += 1
        while (self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.max_num_seqs
               and not preempted):
            seq = self.waiting[0]
            # An embedding request runs whole in one step (bidirectional attention needs every
            # token at once); it and a prompt-logprobs request need every row's output, so no
            # prefix hit (device or external) serves them.
            hits = (self.blocks.match_prefix(seq) if seq.reads_prefix_cache
                    else [[] for _ in self.blocks.windows])
            cached = len(hits[0]) * self.blocks.block_size
            external, load_async = self._external_tokens(seq, cached)
            count = 0 if external and load_async else min(seq.num_tokens - cached - external, budget)
            if ((seq.pooling is not None and count < seq.num_tokens)
                    or not self.blocks.can_admit(external + count, hits)):
                break  # first come first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.blocks.admit(seq, hits)
            self.blocks.grow(seq, seq.num_computed + external + count)
            if seq.num_preemptions == 0:
                seq.num_cached_prefix = seq.num_computed
            if self.connector is not None and seq.pooling is None:
                request = self.connector_request(seq)
                self.connector.update_state_after_alloc(request, seq.block_tables, cached, external)
            if external and load_async:  # it waits for its load; the budget goes to the next request
                seq.status, seq.num_loading = Status.LOADING, external
                self.loading.append(seq)
                continue
            if external:  # loaded in this step, layer by layer: it computes after the loaded tokens
                seq.num_computed += external
                self.loaded_in_step.append((seq, external))
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, count))
            budget -= count
        chunks.sort(key=lambda c: not c.is_decode)  # stable: decodes first, FCFS within each kind
        return chunks

    def _external_tokens(self, seq: Sequence, cached: int) -> tuple[int, bool]:
        """Tokens past the device prefix hit that the connector can load (0 without one), and
        whether their load is asynchronous."""
        if self.connector is None or not seq.reads_prefix_cache:
            return 0, True
        external, load_async = self.connector.get_num_new_matched_tokens(self.connector_request(seq), cached)
        if external < 0 or external % self.blocks.block_size or cached + external >= seq.num_tokens:
            raise RuntimeError(f"KV connector offered {external} tokens past {cached} of a "
                               f"{seq.num_tokens}-token request: whole blocks, short of the last token")
        return external, load_async

    def _ends_in_flight(self, seq: Sequence) -> bool:
        """Whether the token `seq` has in flight is its last (max_tokens, max_model_len)."""
        ahead = seq.num_tokens_ahead
        return (ahead - seq.prompt_len >= seq.params.max_tokens
                or self.max_model_len is not None and ahead >= self.max_model_len)

    def _with_lookahead(self, seq: Sequence, num_tokens: int) -> int:
        """The slots to hold: `num_tokens` and the lookahead past them, where the pool has it."""
        if not self.lookahead:
            return num_tokens
        last = seq.prompt_len + seq.params.max_tokens
        if self.max_model_len is not None:
            last = min(last, self.max_model_len)
        wanted = min(num_tokens + self.lookahead, last)
        return wanted if wanted > num_tokens and self.blocks.can_grow(seq, wanted) else num_tokens

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.WAITING
        seq.num_computed = 0
        seq.draft_ids, seq.draft_probs = [], None  # proposed again once it decodes
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == Status.WAITING:  # preempted while its last token was in flight
            self.waiting.remove(seq)
            self.blocks.release(seq)
        else:
            self.running.remove(seq)
            self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is and free its blocks (a loading request's once its
        transfer ends)."""
        if seq.status == Status.FINISHED:
            return
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
            self.blocks.release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = "abort"

    def _release(self, seq: Sequence) -> None:
        """Free a request's blocks, unless the connector still reads them."""
        if self.connector is not None and seq.pooling is None:
            rid = str(seq.request_id)
            if self.connector.request_finished(rid, seq.block_tables):
                self.held[rid] = seq
                return
        self.blocks.release(seq)

"""Continuous batching: a per-step token budget, chunked prefill, FCFS, preemption by recompute.

Each step first continues the running requests in admission order (decodes and unfinished
prefill chunks), then admits waiting requests while the budget, `max_num_seqs` and the block
pool allow. When a running request needs a block and none is free, the newest running request
is preempted: its blocks are released and it goes back to the front of the queue, to be
recomputed (prompt and generated tokens) later. Before any of that, running requests hand back
the sliding-window blocks their next queries no longer see.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from jackfield.engine.block_manager import BlockManager
from jackfield.engine.sequence import Sequence, Status


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # query rows this step, from seq.num_computed on (drafts included)
    num_drafts: int = 0  # the last rows are seq.draft_ids[:num_drafts], verified this step

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens, so the step samples the next one."""
        return self.seq.num_computed + self.num_tokens - self.num_drafts == self.seq.num_tokens

    @property
    def prompt_logprob_positions(self) -> range:
        """Positions of this chunk whose output scores the next prompt token (prompt_logprobs)."""
        seq = self.seq
        if seq.params.prompt_logprobs is None or seq.pooling is not None:
            return range(0)
        return range(seq.num_computed, min(seq.num_computed + self.num_tokens, seq.prompt_len - 1))

    @property
    def is_decode(self) -> bool:
        """One known token (and its drafts): the attention backends' decode role serves it."""
        return self.num_tokens - self.num_drafts == 1


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

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
                self.blocks.grow(seq, seq.num_computed + count)
                chunks.append(ScheduledChunk(seq, count, drafts))
                budget -= count
                index += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            # An embedding request runs whole in one step (bidirectional attention needs every
            # token at once); it and a prompt-logprobs request need every row's output, so no
            # prefix hit serves them.
            hits = (self.blocks.match_prefix(seq) if seq.reads_prefix_cache
                    else [[] for _ in self.blocks.windows])
            count = min(seq.num_tokens - len(hits[0]) * self.blocks.block_size, budget)
            if (seq.pooling is not None and count < seq.num_tokens) or not self.blocks.can_admit(count, hits):
                break  # first come first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.blocks.admit(seq, hits)
            self.blocks.grow(seq, seq.num_computed + count)
            if seq.num_preemptions == 0:
                seq.num_cached_prefix = seq.num_computed
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, count))
            budget -= count
        chunks.sort(key=lambda c: not c.is_decode)  # stable: decodes first, FCFS within each kind
        return chunks

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.WAITING
        seq.num_computed = 0
        seq.draft_ids = []  # proposed again once it decodes
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is (queued or running) and free its blocks."""
        if seq.status == Status.FINISHED:
            return
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = "abort"

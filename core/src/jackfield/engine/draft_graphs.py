"""A chain drafter's whole drafting phase of a decode step, replayed from CUDA graphs.

An eager drafting phase of EAGLE-3 (k = 3) costs ~5 ms of host time on the H200 against a
~1.6 ms decode step: k forwards of a one-layer head, each ~25 kernel launches behind Python, and
their attention metadata. Here each of the decode graphs' (batch size, rows a request) gets
graphs of the drafting that follows its replay (`ChainDrafter`): the drafter's layers over the
step's verified rows, then token 0 from each request's newest verified row, then drafts 1 ..
k - 1, each from one row per request that feeds the previous draft and its output back, every
draft sampled on the device (one graph for all-greedy batches, one for batches that draw).

Inputs, by address: the decode graph's own outputs (the target's final hidden states and tapped
layer inputs, q rows a request padded to the batch size) and static buffers (positions, lengths,
block tables) that its step just filled; the drafting's own static buffers (each verified row's
next token, the slots of the rows that write KV, each request's newest verified row, every
chain row's position, length and slot, the requests' temperatures, seeds and token counts),
written before each replay. A request's rows past its verified ones (rejected drafts, padding)
write no KV (slot -1); a chain row of a request that drafts no further (its limit, or not
drafting at all) and the padding requests' rows see no KV (length 0) and write none; their
drafts are dropped at the one read-back of the phase.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from jackfield.contracts.attention import StepContext
from jackfield.contracts.drafter import ChainDrafter, DraftRows
from jackfield.contracts.sampler import Sampler
from jackfield.engine.cuda_graphs import DecodeGraphs
from jackfield.engine.drafting import VerifiedRows, drawn_drafts, greedy_drafts
from jackfield.engine.scheduler import ScheduledChunk
from jackfield.ops.staging import CopyFence, CpuGpuBuffer

Drafts = list[tuple[list[int], torch.Tensor | None]]  # per chunk: its drafts and their probabilities


class DraftGraphs:
    """Per decode graph (batch size, rows a request) and kind of sampling (greedy, drawn), one
    CUDA graph of the drafting phase that follows it."""

    def __init__(self, decode: DecodeGraphs, drafter: ChainDrafter, sampler: Sampler, vocab_size: int,
                 record: bool = True) -> None:
        """`decode`: the model's decode graphs, captured first; `sampler`: drawn drafts are
        recorded when it `records_plain_draws` (else such steps draft eagerly). record=False runs
        the same drafting over the same static buffers and capture-time metadata without graphs
        (on any device), after a `decode` of record=False too."""
        self.decode, self.drafter, self.sampler, self.record = decode, drafter, sampler, record
        self.num_drafts = drafter.num_speculative_tokens
        device = decode.input_ids.gpu.device
        largest, chain = decode.sizes[-1], self.num_drafts - 1
        rows = largest * decode.query_lens[-1]
        groups = range(len(decode.slot_mapping))
        # each verified row's next token
        self.input_ids = CpuGpuBuffer(rows, dtype=torch.int64, device=device)
        self.slot_mapping = [CpuGpuBuffer(rows, dtype=torch.int64, device=device) for _ in groups]
        self.last_rows = CpuGpuBuffer(largest, dtype=torch.int64, device=device)
        # per draft j >= 1 (row j - 1), per request: its chain row's position, length and slots
        self.chain_positions = CpuGpuBuffer(chain, largest, dtype=torch.int64, device=device)
        self.chain_seq_lens = CpuGpuBuffer(chain, largest, dtype=torch.int32, device=device)
        self.chain_slots = [CpuGpuBuffer(chain, largest, dtype=torch.int64, device=device) for _ in groups]
        self.temperature = CpuGpuBuffer(largest, dtype=torch.float32, device=device)
        self.seeds = CpuGpuBuffer(largest, dtype=torch.int64, device=device)
        self.num_tokens = CpuGpuBuffer(largest, dtype=torch.int64, device=device)  # after the step
        self.fence = CopyFence(device)  # the host buffers above are rewritten each step
        # the outputs: each draft's tokens, and the probabilities drawn drafts came from
        self.tokens = torch.zeros(self.num_drafts, largest, dtype=torch.int64, device=device)
        # greedy graphs always; drawn ones where the sampler's plain draws can be recorded
        self.kinds = (False, True) if sampler.records_plain_draws else (False,)
        self.probs = (torch.zeros(largest, self.num_drafts, vocab_size, dtype=torch.float32, device=device)
                      if True in self.kinds else None)
        # per (batch size, rows a request, drawn): the graph and the step contexts it reads by address
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, list[StepContext]]] = {}
        self.unrecorded: dict[tuple[int, int], list[StepContext]] = {}  # record=False: the contexts

    def capture(self, progress: Callable[[str], None] | None = None) -> None:
        pool = torch.cuda.graph_pool_handle() if self.record else None
        decode = self.decode
        for q in reversed(decode.query_lens):
            for size in reversed(decode.sizes):
                if progress:
                    progress(f"capturing drafting CUDA graphs: batch {size}, {q} verified rows a request")
                self._fill([], None, size, q)
                contexts = self._contexts(size, q)
                if pool is None:
                    self.unrecorded[size, q] = contexts
                    continue
                _, hidden, states, _ = decode.graphs[size, q]
                for drawn in self.kinds:
                    # warm-up, then capture with fresh positions views (RoPE gathers per tensor)
                    self._drafting(size, q, drawn, contexts, hidden, states)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._drafting(size, q, drawn, contexts, hidden, states)
                    self.graphs[size, q, drawn] = (graph, contexts)
        if pool is not None:
            torch.cuda.synchronize()

    def _contexts(self, size: int, q: int) -> list[StepContext]:
        """The verified rows' step context, then each chain draft's, over the static buffers."""
        decode = self.decode
        slots = [b.gpu[: size * q] for b in self.slot_mapping]
        verified = decode.static_metadata(size, q, slot_mapping=slots)
        chain = [decode.static_metadata(size, 1, self.chain_seq_lens.gpu[j, :size],
                                        [b.gpu[j, :size] for b in self.chain_slots])
                 for j in range(self.num_drafts - 1)]
        return [decode.contexts.build(decode.kv_caches, per_group, for_capture=True,
                                      kv_scales=decode.kv_scales)
                for per_group in (verified, *chain)]

    def _drafting(self, size: int, q: int, drawn: bool, contexts: list[StepContext], hidden: torch.Tensor,
                  taps: list[torch.Tensor | None]) -> None:
        """The drafting over the static buffers: each draft's tokens (and probabilities) into the
        output buffers."""
        drafter, model = self.drafter, self.decode.model
        rows = size * q
        assert all(t is not None for t in taps), "the decode graphs give every tapped layer's input"
        verified = DraftRows(self.input_ids.gpu[:rows], self.decode.positions.gpu[:rows], hidden, contexts[0])
        out = drafter.verified_forward(model, verified, taps)  # type: ignore[arg-type]  # checked above
        out = out.index_select(0, self.last_rows.gpu[:size])
        temperature, seeds = self.temperature.gpu[:size], self.seeds.gpu[:size]
        num_tokens = self.num_tokens.gpu[:size]
        tokens = None
        for draft in range(self.num_drafts):
            if tokens is not None:
                row = DraftRows(tokens.clamp(min=0), self.chain_positions.gpu[draft - 1, :size], out,
                                contexts[draft])
                out = drafter.draft_forward(model, draft, row)
            logits = drafter.draft_logits(model, draft, out)
            if drawn:
                assert self.probs is not None
                tokens, probs = drawn_drafts(self.sampler, logits, temperature, seeds, num_tokens + draft)
                self.probs[:size, draft].copy_(probs)
            else:
                tokens = greedy_drafts(logits)
            self.tokens[draft, :size].copy_(tokens)

    def run(self, chunks: list[ScheduledChunk], q: int, found: VerifiedRows) -> Drafts | None:
        """Per chunk, its drafts and their probabilities (None: greedy), after the decode graph
        of (this batch's size, q) replayed the step's `chunks`; None: the step drafts eagerly
        (drawn drafts that the sampler cannot record)."""
        drawn = any(seq.params.temperature > 0 for seq, _ in found.drafting)
        if drawn not in self.kinds:
            return None
        size = next(s for s in self.decode.sizes if s >= len(chunks))
        self._fill(chunks, found, size, q)
        if self.record:
            graph, _ = self.graphs[size, q, drawn]
            last = self.decode.last_outputs  # the replayed step's: the graph reads them by address
            assert last is not None and last[0] is self.decode.graphs[size, q][1], "another graph replayed"
            graph.replay()
        else:
            assert self.decode.last_outputs is not None
            hidden, taps = self.decode.last_outputs
            self._drafting(size, q, drawn, self.unrecorded[size, q], hidden, taps)
        n = len(chunks)
        probs = self.probs[:n].clone() if drawn else None  # type: ignore[index]  # the next replay rewrites them
        tokens = self.tokens[:, :n].tolist()  # the phase's one read-back
        limits = {seq: limit for (seq, _), limit in zip(found.drafting, found.max_drafts, strict=True)}
        drafts: Drafts = []
        for i, chunk in enumerate(chunks):
            own: list[int] = []
            for draft in range(limits.get(chunk.seq, 0)):
                if tokens[draft][i] < 0:  # no finite logit: this request drafts no further
                    break
                own.append(tokens[draft][i])
            greedy = chunk.seq.params.temperature == 0  # its drafts are checked by argmax alone
            drafts.append((own, probs[i, : len(own)] if probs is not None and own and not greedy else None))
        return drafts

    def _fill(self, chunks: list[ScheduledChunk], found: VerifiedRows | None, size: int, q: int) -> None:
        """Write the step's drafting inputs into the static buffers (capture: no rows, `found`
        None). The decode graph's fill of the same chunks left the positions, lengths and block
        tables of their verified rows (the first of each request's q rows). The index arithmetic
        runs in numpy over the pinned host buffers: at batch 1 torch's per-op dispatch was most
        of the drafting phase's host time."""
        self.fence.wait()
        decode, n, chain = self.decode, len(chunks), self.num_drafts - 1
        bs = decode.block_size
        starts = np.zeros(size, dtype=np.int64)
        starts[:n] = [c.seq.num_computed for c in chunks]
        verified = np.zeros(size, dtype=np.int64)  # rows a request
        after = self.num_tokens.np[:size]  # tokens after the step, 0: not drafting
        limit = np.zeros(size, dtype=np.int64)
        ids = self.input_ids.np[: size * q].reshape(size, q)
        temperature, seeds = self.temperature.np[:size], self.seeds.np[:size]
        for values in (after, ids, temperature, seeds):
            values.fill(0)
        if found is not None:
            # every chunk is a decode, so each has one span of verified rows, in chunk order
            drafting = {seq: (tokens, limit) for (seq, tokens), limit in zip(found.drafting, found.max_drafts,
                                                                           strict=True)}
            at = 0
            for i, (chunk, span) in enumerate(zip(chunks, found.spans, strict=True)):
                verified[i] = span.count
                ids[i, : span.count] = found.input_ids[at : at + span.count]
                at += span.count
                if chunk.seq in drafting:
                    after[i], limit[i] = drafting[chunk.seq]
                    temperature[i], seeds[i] = chunk.seq.params.temperature, chunk.seq.seed
        offsets = np.arange(q)
        positions = starts[:, None] + offsets  # [size, q]
        writes = offsets < verified[:, None]
        draft = np.arange(1, chain + 1)
        chain_positions = after[:, None] + draft - 2  # [size, chain]: draft j's row at N + j - 2
        chain_live = draft < limit[:, None]
        self.last_rows.np[:size] = np.arange(size) * q + np.maximum(verified - 1, 0)
        self.chain_positions.np[:, :size] = np.where(chain_live, chain_positions, 0).T
        self.chain_seq_lens.np[:, :size] = np.where(chain_live, chain_positions + 1, 0).T
        tables = decode.block_tables.gather_array([c.seq.table_row for c in chunks])  # type: ignore[misc]
        width = tables.shape[2]
        requests = np.arange(n)[:, None]
        for g, (slot_mapping, chain_slots) in enumerate(zip(self.slot_mapping, self.chain_slots,
                                                            strict=True)):
            slot_mapping.np[: size * q] = -1
            chain_slots.np[:, :size] = -1
            if n:  # the decode graphs' fill checked the tables' block ids
                table = tables[g].astype(np.int64)
                for at, live, slots in ((positions[:n], writes[:n], slot_mapping.np[: n * q].reshape(n, q)),
                                        (chain_positions[:n], chain_live[:n], chain_slots.np[:, :n].T)):
                    # a chain row that drafts nothing sits at position -1: clipped, its slot is -1
                    index = np.clip(at // bs, 0, width - 1)
                    slots[...] = np.where(live, table[requests, index] * bs + at % bs, -1)
            slot_mapping.copy_to_device(size * q)
            chain_slots.copy_to_device()
        for buffer, count in ((self.input_ids, size * q), (self.last_rows, size), (self.temperature, size),
                              (self.seeds, size), (self.num_tokens, size)):
            buffer.copy_to_device(count)
        self.chain_positions.copy_to_device()
        self.chain_seq_lens.copy_to_device()
        self.fence.record()

"""A chain drafter's whole drafting phase of a decode step, replayed from CUDA graphs.

An eager drafting phase of EAGLE-3 (k = 3) costs ~5 ms of host time on the H200 against a
~1.6 ms decode step: k forwards of a one-layer head, each ~25 kernel launches behind Python, and
their attention metadata. Here each of the decode graphs' (batch size, rows a request) gets
graphs of the drafting that follows its replay (`ChainDrafter`): the drafter's layers over the
step's verified rows, then token 0 from each request's newest verified row, then drafts 1 ..
k - 1, each from one row per request that feeds the previous draft and its output back, every
draft sampled on the device (one graph for all-greedy batches, one for batches that draw).

Acceptance on the device. What the drafting reads depends on each request's accepted count a
(its verified rows 0 .. a, their next tokens, its newest verified row, its chain rows'
positions and its draft limit), and at batch 1 waiting for the host to learn a cost ~0.4 ms of
idle GPU a step (the verify tokens' read-back, acceptance, the fill, then the drafting's
launch). So the host fills, before it knows a, everything else and, for what depends on a, the
value at every possible a (at most q variants a request: tiny arrays), packed in one pinned
buffer and copied with one copy; each graph begins by counting a on the device (`_select`): the
leading drafts of the step (the decode graph's input rows 1 .. q - 1 of each request, masked by
its own draft count) that equal the target's tokens at the rows before them, the greedy rule of
`greedy_accept`, then gathers the variants at a. A plain greedy step (`run_greedy`) launches its
drafting right behind the verify's argmax, which the graph reads from the device, and reads the
verify tokens and the drafts back together: one read-back a step. Other steps (`run`) read the
verify's tokens first (their rows' acceptance may be random, or need logprobs) and hand the
graph the emitted tokens and accepted counts instead: the same rule then counts the same a.

Inputs, by address: the decode graph's own inputs and outputs (its input ids, the target's
final hidden states and tapped layer inputs, q rows a request padded to the batch size, and
the positions, lengths and block tables its step just filled) and the drafting's staged inputs
above. A request's rows past its verified ones (rejected drafts, padding) write no KV (slot
-1); a chain row of a request that drafts no further (its limit, or not drafting at all) and
the padding requests' rows see no KV (length 0) and write none; their drafts are dropped at the
read-back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from jackfield.contracts.attention import StepContext
from jackfield.contracts.drafter import ChainDrafter, DraftRows
from jackfield.contracts.sampler import Sampler
from jackfield.engine.block_table import slots_at
from jackfield.engine.cuda_graphs import DecodeGraphs
from jackfield.engine.drafting import DraftLimits, drawn_drafts, greedy_drafts
from jackfield.engine.scheduler import ScheduledChunk
from jackfield.ops.staging import CopyFence, CpuGpuBuffer

Drafts = list[tuple[list[int], torch.Tensor | None]]  # per chunk: its drafts and their probabilities


@dataclass(frozen=True)
class StagedInputs:
    """The drafting inputs of one (batch size, q), packed at the front of the pinned staging
    buffer: `host` views to fill, `device` views the graph reads (the same memory off CUDA).
    - verify [size * q]: the verify's tokens, the step's rows in order (a request's 1 + its
      drafts): its argmax copied on the device (`run_greedy`), or the emitted tokens (`run`)
    - token_rows [size * q]: per request and row, its token's index in `verify` (rows past a
      request's drafts repeat its last)
    - counts [size]: the drafts each request's accepted count may reach
    - slots [groups, size, q]: each row's KV slot should it be verified (-1: a padding row)
    - seeds, after [size]: drawn drafts' seeds; tokens after the step were a = 0
    - chain [q, 2 + groups, chain, size]: per accepted count, per draft j >= 1 (row j - 1), each
      request's chain row's position, length, and slot per group"""

    length: int
    host: dict[str, np.ndarray]
    device: dict[str, torch.Tensor]


@dataclass(frozen=True)
class GreedyDrafting:
    """A plain greedy step's verify tokens and drafts, read back together (`run_greedy`)."""

    token_ids: list[int]  # the verify's tokens, the step's rows in order (as the sampled tokens)
    rows: list[list[int]]  # per chunk: its row of the read-back (drafts at `first_draft` on)
    limits: np.ndarray  # [chunks, q]: each request's draft limit at each accepted count
    first_draft: int

    def drafts(self, emitted: list[list[int]]) -> Drafts:
        """Per chunk its drafts (greedy: no probabilities), given its new tokens."""
        return [(_own_drafts(row[self.first_draft :], self.limits[i, len(new) - 1]), None)
                for i, (row, new) in enumerate(zip(self.rows, emitted, strict=True))]


def _own_drafts(tokens: list[int], limit: int) -> list[int]:
    """A request's first `limit` drafts, up to its first with no finite logit (it drafts no further)."""
    own = tokens[:limit]
    return own[: own.index(-1)] if -1 in own else own


class DraftGraphs:
    """Per decode graph (batch size, rows a request) and kind of sampling (greedy, drawn), one
    CUDA graph of the drafting phase that follows it."""

    def __init__(self, decode: DecodeGraphs, drafter: ChainDrafter, sampler: Sampler, vocab_size: int,
                 limits: DraftLimits, record: bool = True) -> None:
        """`decode`: the model's decode graphs, captured first; `sampler`: drawn drafts are
        recorded when it `records_plain_draws` (else such steps draft eagerly); `limits`: what
        bounds each request's drafts. record=False runs the same drafting over the same static
        buffers and capture-time metadata without graphs (on any device), after a `decode` of
        record=False too."""
        self.decode, self.drafter, self.sampler, self.record = decode, drafter, sampler, record
        self.limits = limits
        self.num_drafts = drafter.num_speculative_tokens
        device = decode.input_ids.gpu.device
        largest, widest = decode.sizes[-1], decode.query_lens[-1]
        self.chain_len, self.groups = self.num_drafts - 1, len(decode.slot_mapping)
        rows = largest * widest
        # the staged inputs (`StagedInputs`): one pinned buffer, one copy a step
        longest = sum(int(np.prod(shape)) for shape in self._shapes(largest, widest).values())
        self.staged = CpuGpuBuffer(longest, dtype=torch.int64, device=device)
        self.inputs: dict[tuple[int, int], StagedInputs] = {}
        self.temperature = CpuGpuBuffer(largest, dtype=torch.float32, device=device)  # drawn steps'
        self.fence = CopyFence(device)  # the host buffers above are rewritten each step
        # what `_select` writes on the device from them, and the drafting reads: each verified
        # row's next token and KV slots (per group), each request's newest verified row, per
        # draft j >= 1 (row j - 1) and request its chain row's position, length and slots (per
        # group), the tokens after the step (drawn drafts' positions)
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slots = torch.full((self.groups, rows), -1, dtype=torch.int64, device=device)
        self.last_rows = torch.zeros(largest, dtype=torch.int64, device=device)
        self.chain = torch.zeros(2 + self.groups, self.chain_len, largest, dtype=torch.int64, device=device)
        self.chain_seq_lens = torch.zeros(self.chain_len, largest, dtype=torch.int32, device=device)
        self.num_tokens = torch.zeros(largest, dtype=torch.int64, device=device)
        self.offsets = torch.arange(widest, device=device)
        self.requests = torch.arange(largest, device=device)
        # the read-back: per request its verify tokens (q, padded to the widest q), then its drafts
        self.first_draft = widest
        self.results = CpuGpuBuffer(largest, widest + self.num_drafts, dtype=torch.int64, device=device)
        # greedy graphs always; drawn ones where the sampler's plain draws can be recorded
        self.kinds = (False, True) if sampler.records_plain_draws else (False,)
        # the probabilities drawn drafts came from
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
                self._prepare([], size, q, np.zeros((0, q), dtype=np.int64), None, False)
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
        decode, groups = self.decode, range(self.groups)
        verified = decode.static_metadata(size, q, slot_mapping=[self.slots[g, : size * q] for g in groups])
        chain = [decode.static_metadata(size, 1, self.chain_seq_lens[j, :size],
                                        [self.chain[2 + g, j, :size] for g in groups])
                 for j in range(self.chain_len)]
        return [decode.contexts.build(decode.kv_caches, per_group, for_capture=True,
                                      kv_scales=decode.kv_scales)
                for per_group in (verified, *chain)]

    def _shapes(self, size: int, q: int) -> dict[str, tuple[int, ...]]:
        """The `StagedInputs` of (size, q), in their order in the staging buffer."""
        return {"verify": (size * q,), "token_rows": (size * q,), "counts": (size,),
                "slots": (self.groups, size, q), "seeds": (size,), "after": (size,),
                "chain": (q, 2 + self.groups, self.chain_len, size)}

    def _staged(self, size: int, q: int) -> StagedInputs:
        inputs = self.inputs.get((size, q))
        if inputs is None:
            host, device, at = {}, {}, 0
            for name, shape in self._shapes(size, q).items():
                end = at + int(np.prod(shape))
                host[name] = self.staged.np[at:end].reshape(shape)
                device[name] = self.staged.gpu[at:end].view(shape)
                at = end
            inputs = self.inputs[size, q] = StagedInputs(at, host, device)
        return inputs

    def _select(self, size: int, q: int, drawn: bool) -> None:
        """The graph's first kernels: each request's accepted count a, counted as `greedy_accept`
        counts it (the leading drafts, up to its count, equal to the verify's token at the row
        before), then the drafting's inputs at a; the verify tokens into the read-back."""
        staged = self._staged(size, q).device
        rows = size * q
        tokens = staged["verify"].index_select(0, staged["token_rows"]).view(size, q)
        self.results.gpu[:size, :q].copy_(tokens)
        drafted = self.decode.input_ids.gpu[:rows].view(size, q)[:, 1:]  # each request's drafts
        matched = (drafted == tokens[:, :-1]) & (self.offsets[: q - 1] < staged["counts"].unsqueeze(1))
        accepted = matched.long().cumprod(dim=1).sum(dim=1)
        # a token -1 (no finite logit) fails the step at the read-back: the embedding must not see it
        self.input_ids[:rows].copy_(tokens.clamp(min=0).view(rows))
        verified = self.offsets[:q] <= accepted.unsqueeze(1)  # rows 0 .. a write KV
        self.slots[:, :rows].copy_(torch.where(verified, staged["slots"], -1).view(self.groups, rows))
        self.last_rows[:size].copy_(self.requests[:size] * q + accepted)
        index = accepted.view(1, 1, 1, size).expand(1, 2 + self.groups, self.chain_len, size)
        chosen = staged["chain"].gather(0, index)[0]
        self.chain[:, :, :size].copy_(chosen)
        self.chain_seq_lens[:, :size].copy_(chosen[1])
        if drawn:
            self.num_tokens[:size].copy_(staged["after"] + accepted)

    def _drafting(self, size: int, q: int, drawn: bool, contexts: list[StepContext], hidden: torch.Tensor,
                  taps: list[torch.Tensor | None]) -> None:
        """The drafting over the static buffers: each draft's tokens (and probabilities) into the
        output buffers."""
        drafter, model = self.drafter, self.decode.model
        rows = size * q
        assert all(t is not None for t in taps), "the decode graphs give every tapped layer's input"
        self._select(size, q, drawn)
        verified = DraftRows(self.input_ids[:rows], self.decode.positions.gpu[:rows], hidden, contexts[0])
        out = drafter.verified_forward(model, verified, taps)  # type: ignore[arg-type]  # checked above
        out = out.index_select(0, self.last_rows[:size])
        temperature, seeds = self.temperature.gpu[:size], self._staged(size, q).device["seeds"]
        num_tokens = self.num_tokens[:size]
        tokens = None
        for draft in range(self.num_drafts):
            if tokens is not None:
                row = DraftRows(tokens.clamp(min=0), self.chain[0, draft - 1, :size], out, contexts[draft])
                out = drafter.draft_forward(model, draft, row)
            logits = drafter.draft_logits(model, draft, out)
            if drawn:
                assert self.probs is not None
                tokens, probs = drawn_drafts(self.sampler, logits, temperature, seeds, num_tokens + draft)
                self.probs[:size, draft].copy_(probs)
            else:
                tokens = greedy_drafts(logits)
            self.results.gpu[:size, self.first_draft + draft].copy_(tokens)

    def run(self, chunks: list[ScheduledChunk], q: int, emitted: list[list[int]]) -> Drafts | None:
        """Per chunk, its drafts and their probabilities (None: greedy), after the decode graph
        of (this batch's size, q) replayed the step's `chunks` and the host verified its tokens
        (`emitted`: each chunk's new tokens); None: the step drafts eagerly (drawn drafts that
        the sampler cannot record)."""
        limits = self.limits.max_drafts([c.seq for c in chunks], np.arange(1, q + 1))
        own = [int(limits[i, len(new) - 1]) for i, new in enumerate(emitted)]
        drawn = any(c.seq.params.temperature > 0 and limit for c, limit in zip(chunks, own, strict=True))
        if drawn not in self.kinds:
            return None
        size = next(s for s in self.decode.sizes if s >= len(chunks))
        self._prepare(chunks, size, q, limits, emitted, drawn)
        self._replay(size, q, drawn)
        n = len(chunks)
        probs = self.probs[:n].clone() if drawn else None  # type: ignore[index]  # the next replay rewrites them
        drafts: Drafts = []
        for i, (chunk, row, limit) in enumerate(zip(chunks, self._read_back(n), own, strict=True)):
            ids = _own_drafts(row[self.first_draft :], limit)
            greedy = chunk.seq.params.temperature == 0  # its drafts are checked by argmax alone
            drafts.append((ids, probs[i, : len(ids)] if probs is not None and ids and not greedy else None))
        return drafts

    def run_greedy(self, chunks: list[ScheduledChunk], q: int, tokens: torch.Tensor) -> GreedyDrafting:
        """A plain greedy step's drafting (every request's verify is its argmax), replayed right
        behind its verify: `tokens` are the argmax of the step's rows (as `run` would have read
        them back), still on the device. Then the step's one read-back: its verify tokens and
        its drafts at every request's accepted count."""
        limits = self.limits.max_drafts([c.seq for c in chunks], np.arange(1, q + 1))
        size = next(s for s in self.decode.sizes if s >= len(chunks))
        staged = self._prepare(chunks, size, q, limits, None, False)
        staged.device["verify"][: tokens.shape[0]].copy_(tokens)  # behind the staging copy
        self._replay(size, q, False)
        rows = self._read_back(len(chunks))
        token_ids = [t for chunk, row in zip(chunks, rows, strict=True) for t in row[: 1 + chunk.num_drafts]]
        return GreedyDrafting(token_ids, rows, limits, self.first_draft)

    def _replay(self, size: int, q: int, drawn: bool) -> None:
        if self.record:
            graph, _ = self.graphs[size, q, drawn]
            last = self.decode.last_outputs  # the replayed step's: the graph reads them by address
            assert last is not None and last[0] is self.decode.graphs[size, q][1], "another graph replayed"
            graph.replay()
        else:
            assert self.decode.last_outputs is not None
            hidden, taps = self.decode.last_outputs
            self._drafting(size, q, drawn, self.unrecorded[size, q], hidden, taps)

    def _read_back(self, n: int) -> list[list[int]]:
        """The first n requests' rows of the results (one copy into pinned memory, then the host's)."""
        results = self.results
        if results.gpu is not results.cpu:
            results.cpu[:n].copy_(results.gpu[:n])
        return results.cpu[:n].tolist()

    def _prepare(self, chunks: list[ScheduledChunk], size: int, q: int, limits: np.ndarray,
                 emitted: list[list[int]] | None, drawn: bool) -> StagedInputs:
        """Stage the drafting inputs of the step's `chunks` (capture: none) for every accepted
        count a = 0 .. q - 1: `limits` [chunks, q] each request's draft limit at a; `emitted`:
        each chunk's new tokens (None: the verify's argmax goes to the device after). The
        decode graph's fill of the same chunks left their rows' input ids, positions, lengths
        and block tables (and checked the tables' block ids). The index arithmetic runs in
        numpy over the pinned host buffer: at batch 1 torch's per-op dispatch was most of the
        drafting phase's host time."""
        self.fence.wait()
        staged = self._staged(size, q)
        host, n, bs = staged.host, len(chunks), self.decode.block_size
        for name in ("token_rows", "counts", "seeds", "after", "chain"):
            host[name].fill(0)
        host["slots"].fill(-1)
        host["chain"][:, 2:] = -1
        if drawn:
            self.temperature.np[:size] = 0
            self.temperature.np[:n] = [c.seq.params.temperature for c in chunks]
            self.temperature.copy_to_device(size)
        if n:
            seqs = [c.seq for c in chunks]
            drafts = np.array([c.num_drafts for c in chunks], dtype=np.int64)
            offsets = np.arange(q)
            first = np.cumsum(drafts + 1) - drafts - 1  # each request's first row in `verify`
            host["token_rows"].reshape(size, q)[:n] = first[:, None] + np.minimum(offsets, drafts[:, None])
            if emitted is None:
                host["counts"][:n] = drafts
            else:  # the accepted drafts are the emitted tokens before the last: the rule counts a again
                host["counts"][:n] = [len(new) - 1 for new in emitted]
                host["verify"][: int(first[-1] + drafts[-1]) + 1] = [
                    t for new, d in zip(emitted, drafts.tolist(), strict=True)
                    for t in new + new[-1:] * (d + 1 - len(new))]
            host["seeds"][:n] = [s.seed for s in seqs]
            num_tokens = np.array([s.num_tokens for s in seqs], dtype=np.int64)
            host["after"][:n] = num_tokens + 1
            # at each a, draft j's row at N + j - 2 with N = num_tokens + a + 1: [chunks, q, chain]
            draft = np.arange(1, self.chain_len + 1)
            positions = (num_tokens[:, None] + offsets + 1)[:, :, None] + draft - 2
            live = draft < limits[:, :, None]
            chain = host["chain"][..., :n]  # [q, 2 + groups, chain, chunks]
            chain[:, 0] = np.where(live, positions, 0).transpose(1, 2, 0)
            chain[:, 1] = np.where(live, positions + 1, 0).transpose(1, 2, 0)
            rows = np.array([s.num_computed for s in seqs], dtype=np.int64)[:, None] + offsets  # [chunks, q]
            real = offsets <= drafts[:, None]
            tables = self.decode.block_tables.gather_array([s.table_row for s in seqs])  # type: ignore[misc]
            for g, table in enumerate(tables):
                # a padding row, or a chain row that drafts nothing, may sit past its request's
                # blocks: its slot is -1
                host["slots"][g, :n] = np.where(real, slots_at(table, rows, bs), -1)
                chain[:, 2 + g] = np.where(live, slots_at(table, positions, bs), -1).transpose(1, 2, 0)
        self.staged.copy_to_device(staged.length)
        self.fence.record()
        return staged

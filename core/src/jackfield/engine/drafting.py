"""A model drafter's view of one step (`DraftContext`), as the model runner gives it.

After the target's forward and the verification of the step's drafts, before the engine appends
the new tokens, the drafter gets:
- `verified`: every position the target computed this step whose next token is now known, with
  that token and the target's final hidden state there (a prompt chunk: all its rows, or all but
  the last of an embedding request's; a decode: its known row and its accepted drafts; rejected
  drafts' rows are left out). Its attention writes the drafter's KV at those positions, so the
  drafter's caches hold every verified position (a rejected draft's KV is overwritten later).
- the requests that draft next: every sampling request the step leaves room for, each with the
  row that drafts its first token and how many it may draft.
Draft token j (0-based) of a request with N tokens after this step sits at position N + j; the
row that drafts token j >= 1 sits at position N + j - 2 (it pairs token j - 1 with the hidden
state that drafted it) and writes its KV there, inside the slots the scheduler reserved. A
drafter that drafts in one block (DFlash) runs rows at N - 1 .. N - 1 + d instead, non-causally.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from jackfield.contracts.attention import StepContext
from jackfield.contracts.drafter import DraftContext, DraftRows, ModelDrafter
from jackfield.contracts.model import ModelFamily
from jackfield.contracts.sampler import Sampler, SamplingMetadata
from jackfield.engine.scheduler import ScheduledChunk
from jackfield.engine.sequence import Sequence as Request
from jackfield.ops.staging import async_tensor_h2d
from jackfield.sampling.speculative import target_probabilities


@dataclass(frozen=True)
class Span:
    """Rows of one request in a forward: positions start .. start + count - 1."""

    seq: Request
    start: int
    count: int


# (spans, how many of them are decodes (first), causal) -> (the step context, positions [T] on the device)
AttentionFor = Callable[[list[Span], int, bool], tuple[StepContext, torch.Tensor]]
# per draft of a chain, its spans (one decode row each) -> per draft, a function that builds (its
# step context, positions [R] on the device) when that draft runs; the rows' metadata of every
# draft are made at once (one pass on the host, one copy to the device)
ChainAttentionFor = Callable[[list[list[Span]]], list[Callable[[], tuple[StepContext, torch.Tensor]]]]


@dataclass(frozen=True)
class DraftLimits:
    """What bounds a request's drafts: its k, max_tokens and max_model_len, its KV slots."""

    num_speculative_tokens: int
    max_model_len: int
    block_size: int
    extra_block_rows: int | None = None  # `ModelDrafter.extra_block_rows`

    def max_drafts(self, seqs: Sequence[Request], new_tokens: np.ndarray) -> np.ndarray:
        """int64 [len(seqs), columns]: the drafts each request may make after `new_tokens` more
        tokens ([len(seqs), 1]: one count a request; [columns]: every request after each): the
        verify step emits up to drafts + 1 tokens, and the row of draft j >= 1 writes KV at
        position N + j - 2 (a block of d + e rows writes up to N - 2 + d + e). Vectorized: the
        drafting graphs bound every request at every accepted count of the step at once."""
        own = np.array([(s.num_tokens, s.params.max_tokens - s.num_output_tokens, len(s.block_tables[0]))
                        for s in seqs], dtype=np.int64).reshape(-1, 3)
        num_tokens = own[:, :1] + new_tokens
        left = own[:, 1:2] - new_tokens
        room = np.minimum(left, self.max_model_len - num_tokens) - 1
        past = 2 if self.extra_block_rows is None else 1 - self.extra_block_rows
        slots = own[:, 2:] * self.block_size - num_tokens + past
        return np.clip(np.minimum(room, slots), 0, self.num_speculative_tokens)


@dataclass(frozen=True)
class VerifiedRows:
    """The step's verified rows (see the module docstring) and the requests that draft next."""

    spans: list[Span]  # decodes first
    num_decode_spans: int
    input_ids: list[int]  # per row: the token after its position
    rows: list[int]  # per row: its row in the step's flat batch
    drafting: list[tuple[Request, int]]  # (request, its tokens after this step)
    last_rows: list[int]  # per drafting request: its newest verified row (an index into `rows`)
    max_drafts: list[int]  # per drafting request, >= 1


def verified_rows(chunks: list[ScheduledChunk], emitted: list[list[int]],
                  limits: DraftLimits) -> VerifiedRows:
    """`chunks`: the step's chunks (decodes first); `emitted`: the new tokens of each sampling,
    non-pooling chunk, in order."""
    spans: list[Span] = []
    decode_spans = 0
    ids: list[int] = []
    rows: list[int] = []
    drafting: list[tuple[Request, int]] = []
    last_rows: list[int] = []
    max_drafts: list[int] = []
    sampling = [c.seq for c in chunks if c.samples and c.seq.pooling is None]
    new_tokens = iter(emitted)
    counts = np.array([len(new) for new in emitted], dtype=np.int64).reshape(-1, 1)
    bounds = iter(limits.max_drafts(sampling, counts)[:, 0].tolist())
    start = 0
    for chunk in chunks:
        seq = chunk.seq
        tokens = seq.token_ids
        known = chunk.num_tokens - chunk.num_drafts
        if chunk.samples and seq.pooling is None:
            new = next(new_tokens)
            tokens = tokens + new  # the accepted drafts, then the target's token
            verified = known + len(new) - 1
            limit = next(bounds)
            if limit:
                drafting.append((seq, len(tokens)))
                last_rows.append(len(rows) + verified - 1)
                max_drafts.append(limit)
        else:  # a prompt chunk: the token after its last row is known unless the prompt ends there
            verified = known - (seq.num_computed + known == seq.num_tokens)
        if verified:
            spans.append(Span(seq, seq.num_computed, verified))
            decode_spans += chunk.is_decode
            ids += tokens[seq.num_computed + 1 : seq.num_computed + 1 + verified]
            rows += range(start, start + verified)
        start += chunk.num_tokens
    return VerifiedRows(spans, decode_spans, ids, rows, drafting, last_rows, max_drafts)


class RunnerDraftContext(DraftContext):
    """`hidden`: the target's final hidden states of every row of the step; `taps`: the inputs
    of the drafter's tapped layers over every row of the step."""

    def __init__(self, model: ModelFamily, sampler: Sampler, attention: AttentionFor,
                 chain_attention: ChainAttentionFor, found: VerifiedRows, hidden: torch.Tensor,
                 taps: Sequence[torch.Tensor] = ()) -> None:
        self.model, self.sampler, self.attention = model, sampler, attention
        self.chain_attention = chain_attention
        self.drafting, self.max_drafts = found.drafting, found.max_drafts
        self.device = hidden.device
        step, positions = attention(found.spans, found.num_decode_spans, True)
        index = self._on_device(found.rows, torch.int64)
        input_ids = self._on_device(found.input_ids, torch.int64)
        self.verified = DraftRows(input_ids, positions, hidden[index], step)
        self.taps = tuple(state[index] for state in taps)
        self.last_rows = self._on_device(found.last_rows, torch.int64)
        # The chain's rows of every draft, made at the first draft_rows (a block drafter never asks):
        # per draft j >= 1, the requests that may draft it (a chain drafts j for exactly these) and
        # what builds their attention.
        self._chain: list[tuple[list[int], Callable[[], tuple[StepContext, torch.Tensor]]]] | None = None
        self._sampling: dict[tuple[int, ...], _DraftSampling] = {}  # per set of requests, see sample()

    def _on_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return async_tensor_h2d(values, dtype, self.device, pin_memory=True)  # pinned: no wait for the device

    def draft_rows(self, requests: Sequence[int], draft: int, input_ids: torch.Tensor,
                   hidden: torch.Tensor) -> DraftRows:
        if draft < 1 or any(draft >= self.max_drafts[r] for r in requests):
            raise ValueError(f"draft {draft} is beyond what requests {list(requests)} may draft")
        if self._chain is None:
            chain = [[r for r, limit in enumerate(self.max_drafts) if j < limit]
                     for j in range(1, max(self.max_drafts))]
            builds = self.chain_attention([[Span(self.drafting[r][0], self.drafting[r][1] + j - 2, 1)
                                             for r in rows] for j, rows in enumerate(chain, start=1)])
            self._chain = list(zip(chain, builds, strict=True))
        rows, build = self._chain[draft - 1]
        if list(requests) == rows:
            step, positions = build()
        else:  # a drafter that stops some requests early: rows of its own
            spans = [Span(self.drafting[r][0], self.drafting[r][1] + draft - 2, 1) for r in requests]
            step, positions = self.attention(spans, len(spans), True)
        return DraftRows(input_ids, positions, hidden, step)

    def block_attention(self, requests: Sequence[int],
                        sizes: Sequence[int]) -> tuple[StepContext, torch.Tensor]:
        if any(not 1 <= size <= self.max_drafts[r] + 1 for r, size in zip(requests, sizes, strict=True)):
            raise ValueError(f"blocks of {list(sizes)} rows are beyond what requests {list(requests)} "
                             "may draft")
        spans = [Span(self.drafting[r][0], self.drafting[r][1] - 1, size) for r, size in zip(requests, sizes,
                                                                                              strict=True)]
        return self.attention(spans, len(spans), False)

    def sample(self, logits: torch.Tensor, requests: Sequence[int], draft: int,
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        seqs = [self.drafting[r][0] for r in requests]
        if all(s.params.temperature == 0 for s in seqs):
            return greedy_drafts(logits), None
        # The requests' sampling inputs go to the device once per step and set of requests (a
        # chain samples every draft of the same requests but for the last drafts of some).
        key = tuple(requests)
        inputs = self._sampling.get(key)
        if inputs is None:
            inputs = self._sampling[key] = _DraftSampling(
                temperature=self._on_device([s.params.temperature for s in seqs], torch.float32),
                seeds=self._on_device([s.seed for s in seqs], torch.int64),
                num_tokens=self._on_device([self.drafting[r][1] for r in requests], torch.int64),
            )
        return drawn_drafts(self.sampler, logits, inputs.temperature, inputs.seeds, inputs.num_tokens + draft)


@dataclass(frozen=True)
class _DraftSampling:
    """Sampling inputs of a set of drafting requests, on the device (draft j's positions:
    num_tokens + j)."""

    temperature: torch.Tensor
    seeds: torch.Tensor
    num_tokens: torch.Tensor


def greedy_drafts(logits: torch.Tensor) -> torch.Tensor:
    """Greedy drafts: per row the argmax of the finite logits (no noise), -1 where none is finite."""
    # neginf too: nan_to_num's default turns -inf into the lowest finite float
    finite = torch.nan_to_num(logits, nan=-torch.inf, posinf=-torch.inf, neginf=-torch.inf)
    best, tokens = finite.max(dim=1)
    return torch.where(best == -torch.inf, -1, tokens)


def drawn_drafts(sampler: Sampler, logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts drawn at each row's temperature from the drafting noise stream (argmax where it is
    0), no filter: (int64 tokens [R], -1 where no logit is finite; float32 probabilities [R, V]
    they were drawn from). Without filters the sampler needs no device sync (`SamplingMetadata`)."""
    metadata = SamplingMetadata(temperature=temperature, top_k=None, top_p=None, min_p=None, seeds=seeds,
                                positions=positions, drafting=True)
    out = sampler.sample(logits, metadata)
    tokens = out.token_ids
    if out.invalid_rows is not None:
        tokens = torch.where(out.invalid_rows, -1, tokens)
    return tokens, target_probabilities(logits, temperature)


def draft_in_step(drafter: ModelDrafter, model: ModelFamily, sampler: Sampler, attention: AttentionFor,
                  chain_attention: ChainAttentionFor, limits: DraftLimits, chunks: list[ScheduledChunk],
                  hidden: torch.Tensor, emitted: list[list[int]], taps: Sequence[torch.Tensor] = (),
                  ) -> list[tuple[list[int], torch.Tensor | None]]:
    """The drafter's layers over the step's verified rows, then per sampling, non-pooling chunk
    (in order) its drafts and their probabilities (None: greedy, or certain drafts). `taps`: the
    drafter's tapped layer inputs over every row of the step."""
    found = verified_rows(chunks, emitted, limits)
    proposal = None
    if found.spans:
        context = RunnerDraftContext(model, sampler, attention, chain_attention, found, hidden, taps)
        proposal = drafter.propose(context)
    index = {seq: i for i, (seq, _) in enumerate(found.drafting)}
    drafts: list[tuple[list[int], torch.Tensor | None]] = []
    for chunk in chunks:
        if not chunk.samples or chunk.seq.pooling is not None:
            continue
        i = index.get(chunk.seq)
        if proposal is None or i is None:
            drafts.append(([], None))
            continue
        tokens = proposal.token_ids[i][: found.max_drafts[i]]
        probs = proposal.probabilities[i] if proposal.probabilities is not None else None
        # a greedy request's drafts are checked by argmax alone (a drawn batch gives it one-hot q)
        greedy = chunk.seq.params.temperature == 0
        drafts.append((tokens, None if probs is None or greedy else probs[: len(tokens)]))
    return drafts

"""Running a Jackfield model by hand, the way the engine does: paged caches with scattered block
tables, hand-built AttentionMetadata, chunked prefill of a batch, then batched greedy decode. A
hybrid model's recurrent layers get a state slot per request (scattered too) and the step's
RecurrentMetadata."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from jackfield.attention.kv_cache import allocate_kv_cache
from jackfield.attention.torch_ref import TorchRefBackend
from jackfield.contracts.attention import AttentionBackends, AttentionMetadata, StepContext
from jackfield.contracts.recurrent import RecurrentStep
from jackfield.models.attention import StepContextBuilder
from jackfield.models.hybrid import allocate_recurrent_states
from jackfield.ops.recurrent import recurrent_metadata

TORCH_REF = AttentionBackends(prefill=TorchRefBackend, decode=TorchRefBackend)


@dataclass
class PagedRun:
    model: nn.Module
    block_size: int
    num_blocks: int
    causal: bool = True

    def __post_init__(self) -> None:
        dtype = next(self.model.parameters()).dtype
        # Random, not zero: a read of a slot nobody wrote shows up as a wrong answer.
        self.caches = [
            allocate_kv_cache(layer, self.num_blocks, self.block_size, dtype, "cpu").normal_()
            for layer in self.model.kv_cache_layers
        ]
        layers = self.model.kv_cache_layers
        self.contexts = StepContextBuilder(TORCH_REF, layers, [0] * len(layers))  # the engine's split
        self.free = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
        self.tables: list[list[int]] = []
        self.lens: list[int] = []
        states = self.model.recurrent_state_layers
        self.conv_states, self.states = allocate_recurrent_states(states, self.MAX_REQUESTS, "cpu")
        for tensor in self.conv_states + self.states:  # random: a state read before written shows
            tensor.normal_()
        self.conv_kernels = {s.conv_kernel for s in states}

    MAX_REQUESTS = 8

    def add(self) -> int:
        self.tables.append([])
        self.lens.append(0)
        return len(self.tables) - 1

    def slot(self, request: int) -> int:
        """The request's state slot (last first: slots and requests differ)."""
        return self.MAX_REQUESTS - 1 - request

    def context(self, spans: list[tuple[int, int, int]], num_decodes: int = 0) -> StepContext:
        """The step context of rows (request, first position, count) per request, decodes first:
        blocks are allocated as needed; lengths are not advanced (`step` does that)."""
        positions, slots, qsl, seq_lens = [], [], [0], []
        for req, start, count in spans:
            end = start + count
            while len(self.tables[req]) * self.block_size < end:
                self.tables[req].append(self.free.pop())
            table = self.tables[req]
            positions += range(start, end)
            bs = self.block_size
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            qsl.append(qsl[-1] + count)
            seq_lens.append(end)
        width = max(len(self.tables[r]) for r, _, _ in spans)
        tables = [self.tables[r] + [0] * (width - len(self.tables[r])) for r, _, _ in spans]
        qsl_t, lens_t = torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
        metadata = AttentionMetadata(
            query_start_loc=qsl_t.clone(),
            seq_lens=lens_t.clone(),
            block_table=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc_cpu=qsl_t,
            seq_lens_cpu=lens_t,
            max_query_len=max(count for _, _, count in spans),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
            num_decode_tokens=sum(count for _, _, count in spans[:num_decodes]),
            causal=self.causal,
        )
        step = self.contexts.build(self.caches, [metadata])
        if not self.states and not self.conv_states:
            return step
        recurrent = recurrent_metadata([count for _, _, count in spans], [self.slot(r) for r, _, _ in spans],
                                       [start > 0 for _, start, _ in spans], [], self.conv_kernels, "cpu")
        return dataclasses.replace(step, recurrent=RecurrentStep(recurrent, self.conv_states, self.states))

    def step(self, chunks: list[tuple[int, list[int]]], num_decodes: int = 0) -> torch.Tensor:
        """chunks: (request, new token ids), decodes first. Returns the hidden states [T, D]."""
        spans = [(req, self.lens[req], len(tokens)) for req, tokens in chunks]
        step = self.context(spans, num_decodes)
        positions = [p for _, start, count in spans for p in range(start, start + count)]
        for req, start, count in spans:
            self.lens[req] = start + count
        ids = [t for _, tokens in chunks for t in tokens]
        with torch.inference_mode():
            return self.model(torch.tensor(ids), torch.tensor(positions), step)


def generate(
    model: nn.Module, prompts: list[list[int]], max_new: int, *, block_size: int = 4, prefill_chunk: int = 5
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Chunked prefill of all prompts together, then batched greedy decode.

    Returns (generated tokens per prompt, logits per prompt over prompt + generated[:-1] rows)."""
    need = sum(-(-(len(p) + max_new) // block_size) for p in prompts)
    run = PagedRun(model, block_size, need + 3)
    reqs = [run.add() for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    for start in range(0, max(len(p) for p in prompts), prefill_chunk):
        chunks = [
            (r, p[start : start + prefill_chunk])
            for r, p in zip(reqs, prompts, strict=True)
            if p[start : start + prefill_chunk]
        ]
        hidden = run.step(chunks)
        rows = torch.split(model.compute_logits(hidden), [len(t) for _, t in chunks])
        for (r, _), row in zip(chunks, rows, strict=True):
            logits[r].append(row)
    out = [[int(logits[r][-1][-1].argmax())] for r in reqs]
    for _ in range(max_new - 1):
        hidden = run.step([(r, out[r][-1:]) for r in reqs], num_decodes=len(reqs))
        step_logits = model.compute_logits(hidden)
        for r in reqs:
            logits[r].append(step_logits[r : r + 1])
            out[r].append(int(step_logits[r].argmax()))
    return out, [torch.cat(rows) for rows in logits]


def assert_generates_like_transformers(model: nn.Module, reference: nn.Module, prompts: list[list[int]],
                                       max_new: int, *, prefill_chunk: int) -> None:
    """`generate` (paged, chunked prefill, batched decode) gives transformers' greedy tokens and
    float32 logits within 1e-4 for every prompt (`reference`: the transformers model)."""
    from jackfield.testing.checkpoints import greedy_reference

    tokens, logits = generate(model, prompts, max_new, block_size=4, prefill_chunk=prefill_chunk)
    for prompt, got_tokens, got_logits in zip(prompts, tokens, logits, strict=True):
        want_tokens, want_logits = greedy_reference(reference, prompt, max_new)  # type: ignore[arg-type]
        assert got_logits.shape == want_logits.shape
        torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
        assert got_tokens == want_tokens

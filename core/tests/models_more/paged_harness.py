"""Running a Jackfield model the way the engine does, by hand: paged caches with scattered block
tables, hand-built AttentionMetadata, chunked prefill of a batch, then batched greedy decode.
Also the transformers side: a real config class, random weights saved as a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from jackfield.attention.kv_cache import allocate_kv_cache
from jackfield.attention.torch_ref import TorchRefBackend
from jackfield.contracts.attention import AttentionBackends, AttentionMetadata
from jackfield.models.attention import StepContextBuilder
from torch import nn
from transformers import PreTrainedModel

TORCH_REF = AttentionBackends(prefill=TorchRefBackend, decode=TorchRefBackend)


def save_hf_model(hf_model: PreTrainedModel, path: Path) -> Path:
    hf_model.save_pretrained(str(path), safe_serialization=True)
    return path


def randomize_(module: nn.Module, names: tuple[str, ...], seed: int) -> None:
    """Parameters that transformers initializes to a constant (sinks: 0, norms: 1) get random
    values, so a model that ignored them would fail the comparison."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.rsplit(".", 1)[-1] in names or any(name.endswith(n) for n in names):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5 + (1.0 if "norm" in name else 0.0))


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

    def add(self) -> int:
        self.tables.append([])
        self.lens.append(0)
        return len(self.tables) - 1

    def step(self, chunks: list[tuple[int, list[int]]], num_decodes: int = 0) -> torch.Tensor:
        """chunks: (request, new token ids), decodes first. Returns the hidden states [T, D]."""
        ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        for req, tokens in chunks:
            start, end = self.lens[req], self.lens[req] + len(tokens)
            while len(self.tables[req]) * self.block_size < end:
                self.tables[req].append(self.free.pop())
            table = self.tables[req]
            ids += tokens
            positions += range(start, end)
            slots += [
                table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)
            ]
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(end)
            self.lens[req] = end
        width = max(len(self.tables[r]) for r, _ in chunks)
        tables = [self.tables[r] + [0] * (width - len(self.tables[r])) for r, _ in chunks]
        qsl_t, lens_t = torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
        metadata = AttentionMetadata(
            query_start_loc=qsl_t.clone(),
            seq_lens=lens_t.clone(),
            block_table=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc_cpu=qsl_t,
            seq_lens_cpu=lens_t,
            max_query_len=max(len(t) for _, t in chunks),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            causal=self.causal,
        )
        step = self.contexts.build(self.caches, [metadata])
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


def hf_reference(
    hf_model: PreTrainedModel, prompt: list[int], max_new: int
) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens (a full forward per token, no cache, no generation-config
    logit processors) and its logits over prompt + generated[:-1]."""
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            ids = torch.tensor([prompt + tokens])
            logits = hf_model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
            tokens.append(int(logits[-1].argmax()))
    return tokens, logits  # the last forward ran over prompt + tokens[:-1]

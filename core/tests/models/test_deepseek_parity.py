"""Jackfield's DeepSeek-V2/V3 against transformers' implementation on the same random checkpoints."""

from __future__ import annotations

import itertools

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.engine.scheduler import ScheduledChunk
from jackfield.engine.sequence import Sequence

VARIANTS = ["v3", "v3-no-qlora-yarn", "v2-grouped", "v2-no-qlora"]


def _reference_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def _run_rows(llm: LLM, chunks: list[ScheduledChunk]) -> list[torch.Tensor]:
    """Logits of every query row, per chunk, through the engine's runner (decodes first)."""
    chunks = sorted(chunks, key=lambda c: c.num_tokens != 1)
    for c in chunks:
        llm.engine.block_manager.grow(c.seq, c.seq.num_computed + c.num_tokens)
    hidden = llm.engine.runner.forward(chunks)
    logits = llm.engine.model.compute_logits(hidden)
    starts = [0, *itertools.accumulate(c.num_tokens for c in chunks)]
    out = [logits[starts[i] : starts[i + 1]] for i in range(len(chunks))]
    for c in chunks:
        c.seq.num_computed += c.num_tokens
    order = {id(c): i for i, c in enumerate(chunks)}
    return [out[order[id(c)]] for c in sorted(chunks, key=lambda c: c.seq.request_id)]


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers_through_chunked_prefill_and_decode(checkpoint, variant: str,
                                                                      block_size: int) -> None:
    directory, reference = checkpoint(variant)
    llm = LLM(directory, backend="torch_ref", block_size=block_size)
    gen = torch.Generator().manual_seed(1)
    lengths = [7, 23, 70]
    seqs = [Sequence(i, n, torch.randint(0, 256, (n,), generator=gen).tolist(), SamplingParams(), 0)
            for i, n in enumerate(lengths)]
    # request 0 then decodes its last token
    first = [n - 1 if i == 0 else n // 2 for i, n in enumerate(lengths)]
    worst = 0.0
    got = _run_rows(llm, [ScheduledChunk(s, f) for s, f in zip(seqs, first, strict=True)])
    got2 = _run_rows(llm, [ScheduledChunk(s, s.num_tokens - f) for s, f in zip(seqs, first, strict=True)])
    rows = [torch.cat([a, b]) for a, b in zip(got, got2, strict=True)]
    for seq, row in zip(seqs, rows, strict=True):
        ref = _reference_logits(reference, seq.token_ids)
        worst = max(worst, (row - ref).abs().max().item())
    for _ in range(3):  # decode steps over random next tokens (absorbed form for every request)
        for seq in seqs:
            seq.token_ids.append(int(torch.randint(0, 256, (1,), generator=gen)))
        rows = _run_rows(llm, [ScheduledChunk(s, 1) for s in seqs])
        for seq, row in zip(seqs, rows, strict=True):
            ref = _reference_logits(reference, seq.token_ids)[-1:]
            worst = max(worst, (row - ref).abs().max().item())
    assert worst <= 1e-4, f"max |logit diff| {worst:.3g}"


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_generation_matches_transformers_generate(checkpoint, variant: str, block_size: int) -> None:
    directory, reference = checkpoint(variant)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 17, 41, 66)]
    llm = LLM(directory, backend="torch_ref", block_size=block_size, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(prompts, outputs, strict=True):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == expected
        assert out.finish_reason == "length"


def test_output_rows_finish_only_the_rows_asked_for(checkpoint) -> None:
    """A step's last layer finishes only the sampling rows; their logits are those of
    transformers at the same positions, and every row's KV is still written (the next chunk
    reads it)."""
    directory, reference = checkpoint("v3")
    llm = LLM(directory, backend="torch_ref", block_size=16)
    gen = torch.Generator().manual_seed(2)
    seqs = [Sequence(i, n, torch.randint(0, 256, (n,), generator=gen).tolist(), SamplingParams(), 0)
            for i, n in enumerate([19, 40])]
    chunks = [ScheduledChunk(s, 12) for s in seqs]  # first chunks: the rest follows below
    for c in chunks:
        llm.engine.block_manager.grow(c.seq, c.num_tokens)
    rows = [3, 11, 12 + 7]  # a middle row, request 0's chunk end, a row of request 1
    hidden = llm.engine.runner.forward(chunks, rows)
    assert hidden.shape[0] == len(rows)
    got = llm.engine.model.compute_logits(hidden)
    want = torch.stack([_reference_logits(reference, seqs[0].token_ids[:12])[3],
                        _reference_logits(reference, seqs[0].token_ids[:12])[11],
                        _reference_logits(reference, seqs[1].token_ids[:12])[7]])
    assert (got - want).abs().max().item() <= 1e-4
    for c in chunks:
        c.seq.num_computed += c.num_tokens
    rest = _run_rows(llm, [ScheduledChunk(s, s.num_tokens - 12) for s in seqs])
    for seq, row in zip(seqs, rest, strict=True):
        assert (row - _reference_logits(reference, seq.token_ids)[12:]).abs().max().item() <= 1e-4

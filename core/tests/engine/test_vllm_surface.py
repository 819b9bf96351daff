"""vLLM's SamplingParams surface through the engine, against transformers on the same checkpoint:
penalties (transformers' own RepetitionPenaltyLogitsProcessor; the OpenAI presence/frequency
rule in float64), `n` samples, and prompt logprobs over chunked prefill."""

from __future__ import annotations

import pytest
import torch
from jackfield import LLM, SamplingParams
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor


@pytest.fixture(scope="module")
def llm(v3_dir) -> LLM:
    return LLM(v3_dir, backend="torch_ref", block_size=16, max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def hf(v3_dir) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(str(v3_dir), dtype=torch.float32).eval()


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_next_logits(hf: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].double()


def test_repetition_penalty_matches_transformers_processor(llm: LLM, hf: PreTrainedModel,
                                                           rng_seed: int) -> None:
    penalty = 4.0
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=penalty)
    plain_params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    # A random model's greedy continuation may never revisit a prompt token, and then the penalty
    # changes nothing: draw prompts until it does, so the comparison below is not vacuous.
    for attempt in range(8):
        ids = prompt(rng_seed + 1000 * attempt, 11)
        ids = ids + ids[:5]  # repeated tokens, so the penalty has something to act on
        got = llm.generate([ids], params, use_tqdm=False)[0].token_ids
        if llm.generate([ids], plain_params, use_tqdm=False)[0].token_ids != got:
            break
    else:
        raise AssertionError("in 8 prompts the penalty never changed the greedy continuation")
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    tokens = list(ids)
    for _ in range(16):
        scores = processor(torch.tensor([tokens]), hf_next_logits(hf, tokens).unsqueeze(0))
        tokens.append(int(scores[0].argmax()))
    assert got == tokens[len(ids):]


def test_presence_and_frequency_penalties_follow_the_openai_rule(llm: LLM, hf: PreTrainedModel,
                                                                 rng_seed: int) -> None:
    """logit - frequency x count - presence x [count > 0] over generated tokens, greedy, in float64."""
    ids = prompt(rng_seed + 1, 9)
    presence, frequency = 1.5, 0.75
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            presence_penalty=presence, frequency_penalty=frequency)
    got = llm.generate([ids], params, use_tqdm=False)[0].token_ids
    out: list[int] = []
    for _ in range(12):
        logits = hf_next_logits(hf, ids + out)
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=logits.numel()).double()
        out.append(int((logits - frequency * counts - presence * (counts > 0).double()).argmax()))
    assert got == out


def test_n_samples_are_the_single_requests_with_consecutive_seeds(llm: LLM, rng_seed: int) -> None:
    ids = prompt(rng_seed + 2, 7)
    seed = rng_seed % 10_000
    params = SamplingParams(n=3, temperature=0.8, seed=seed, max_tokens=8, ignore_eos=True)
    out = llm.generate([ids, ids[:4]], params, use_tqdm=False)
    assert [len(o.outputs) for o in out] == [3, 3]
    for o, p in zip(out, (ids, ids[:4]), strict=True):
        assert [c.index for c in o.outputs] == [0, 1, 2] and o.prompt_token_ids == p
        for i, sample in enumerate(o.outputs):
            alone = llm.generate([p], SamplingParams(temperature=0.8, seed=seed + i, max_tokens=8,
                                                     ignore_eos=True), use_tqdm=False)[0]
            assert sample.seed == seed + i and sample.token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1
    unseeded = llm.generate([ids], SamplingParams(n=2, max_tokens=4), use_tqdm=False)[0]
    assert unseeded.outputs[0].seed != unseeded.outputs[1].seed


@pytest.mark.parametrize("length", [5, 61])  # 61 tokens: three 24-token prefill chunks
def test_prompt_logprobs_are_transformers_log_softmax(llm: LLM, hf: PreTrainedModel, length: int,
                                                      rng_seed: int) -> None:
    ids = prompt(rng_seed + 3, length)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)
    llm.generate([ids], params, use_tqdm=False)  # the second run would hit the prefix cache: it must not
    out = llm.generate([ids], params, use_tqdm=False)[0]
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == length
    assert out.prompt_logprobs[0] is None and out.num_cached_tokens == 0
    for p in range(1, length):
        entry = out.prompt_logprobs[p]
        assert entry is not None
        top = want[p - 1].topk(3)
        assert list(entry)[:3] == top.indices.tolist()
        assert abs(entry[ids[p]] - want[p - 1, ids[p]].item()) < 1e-4
        assert len(entry) == 3 + (ids[p] not in top.indices.tolist())

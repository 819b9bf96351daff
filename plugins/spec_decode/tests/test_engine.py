"""Speculative decoding through the engine: lossless (greedy tokens identical to the engine without
drafts, itself held to transformers elsewhere), drafts accepted and rejected exactly where an
oracle plants them, and the engine's other paths (preemption, chunked prefill, prefix cache,
seeded batches) unchanged with drafts in flight. DeepSeek (MLA) and Llama / Granite SWA (GQA)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.config import ConfigError
from jackfield.contracts.drafter import DrafterOptions, DraftProposal, TokenDrafter
from jackfield.engine.block_manager import max_request_blocks
from jackfield.testing.checkpoints import write_deepseek, write_granite

FAMILIES = ("deepseek_v3", "llama", "granite_swa")
K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
NGRAM = {"speculative.method": "ngram", "speculative.num_speculative_tokens": K,
         "speculative.prompt_lookup_min": 1, "speculative.prompt_lookup_max": 3}
BASE = {"engine.device": "cpu", "attention.backend": "torch_ref", "model.dtype": "float32"}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec_models")
    # room for a prompt holding the whole vocabulary (prompts())
    write_deepseek("v3", root / "deepseek_v3", max_position_embeddings=512)
    for name in ("llama", "granite_swa"):
        write_granite(name, root / name, max_position_embeddings=512)
    return {name: root / name for name in FAMILIES}


def prompts(vocab: int, seed: int) -> list[list[int]]:
    """A repetitive prompt (n-gram lookup finds matches), a random one, a short one."""
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, vocab, (5,), generator=g).tolist()
    return [motif * 4, torch.randint(0, vocab, (17,), generator=g).tolist(), [3, 1]]


def whole_vocabulary(vocab: int, seed: int) -> list[int]:
    """Every token once, shuffled: whatever a random model samples recurs in it, so lookup from
    one token drafts at the first decode (a short motif drafts only if the model happens to sample
    one of its tokens)."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)).tolist()


class Oracle(TokenDrafter):
    """Proposes the reference continuation, with the draft at index (known tokens mod (k + 1))
    replaced by a wrong token: every verify step has a planted rejection, or none when that index
    is past the drafts."""

    name = "oracle"

    def __init__(self, references: list[list[int]], vocab: int, corrupt: bool) -> None:
        super().__init__(DrafterOptions(num_speculative_tokens=K))
        self.references, self.vocab, self.corrupt = references, vocab, corrupt

    def propose(self, token_ids: Sequence[Sequence[int]]) -> DraftProposal:
        drafts = []
        for tokens in token_ids:
            reference = next(r for r in self.references if list(tokens) == r[: len(tokens)])
            draft = reference[len(tokens) : len(tokens) + K]
            planted = len(tokens) % (K + 1)
            if self.corrupt and planted < len(draft):
                draft[planted] = (draft[planted] + 1) % self.vocab
            drafts.append(draft)
        return DraftProposal(drafts)


def expected_acceptance(prompt_len: int, max_tokens: int, corrupt: bool) -> tuple[int, int]:
    """(draft tokens, accepted tokens) the Oracle's plan gives, simulated on the host."""
    known, drafted, accepted = prompt_len + 1, 0, 0  # prefill emits the first token
    while known - prompt_len < max_tokens:
        drafts = min(K, max_tokens - (known - prompt_len) - 1)
        planted = known % (K + 1)
        took = planted if corrupt and planted < drafts else drafts
        drafted, accepted = drafted + drafts, accepted + took
        known += took + 1
    return drafted, accepted


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("corrupt", [False, True], ids=["exact", "planted_rejections"])
def test_oracle_drafts_are_accepted_and_rejected_exactly_as_planted(
        model_dirs: dict[str, Path], family: str, corrupt: bool, rng_seed: int) -> None:
    plain = LLM(str(model_dirs[family]), **BASE)
    vocab = plain.engine.capabilities.vocab_size
    batch = prompts(vocab, rng_seed)
    want = plain.generate(batch, GREEDY)
    spec = LLM(str(model_dirs[family]), **BASE, **NGRAM)
    spec.engine.drafter = Oracle([p + w.token_ids for p, w in zip(batch, want, strict=True)], vocab, corrupt)
    got = spec.generate(batch, GREEDY)
    for prompt, ours, theirs in zip(batch, got, want, strict=True):
        assert ours.token_ids == theirs.token_ids
        stats = ours.speculative
        assert stats is not None
        assert (stats.draft_tokens, stats.accepted_tokens) == expected_acceptance(len(prompt), 24, corrupt)
        assert stats.drafts > 0 and sum(stats.accepted_per_position) == stats.accepted_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_ngram_greedy_tokens_equal_the_engine_without_drafts(model_dirs: dict[str, Path], family: str,
                                                             rng_seed: int) -> None:
    plain = LLM(str(model_dirs[family]), **BASE)
    vocab = plain.engine.capabilities.vocab_size
    batch = [whole_vocabulary(vocab, rng_seed), *prompts(vocab, rng_seed)]
    want = [o.token_ids for o in plain.generate(batch, GREEDY)]
    spec = LLM(str(model_dirs[family]), **BASE, **NGRAM)
    got = spec.generate(batch, GREEDY)
    assert [o.token_ids for o in got] == want
    assert got[0].speculative is not None and got[0].speculative.draft_tokens > 0  # every token recurs


def test_seeded_sampling_with_drafts_is_the_same_alone_and_in_a_batch(model_dirs: dict[str, Path],
                                                                     rng_seed: int) -> None:
    spec = LLM(str(model_dirs["llama"]), **BASE, **NGRAM)
    batch = prompts(spec.engine.capabilities.vocab_size, rng_seed)
    params = SamplingParams(temperature=0.9, top_k=20, max_tokens=24, ignore_eos=True, seed=rng_seed % 1000)
    together = spec.generate(batch, params)
    for prompt, output in zip(batch, together, strict=True):
        assert spec.generate([prompt], params)[0].token_ids == output.token_ids
    assert sum(o.speculative.drafts for o in together if o.speculative) > 0


@pytest.mark.parametrize("family", ["deepseek_v3", "granite_swa"])
def test_preemption_chunked_prefill_and_prefix_cache_with_drafts(model_dirs: dict[str, Path], family: str,
                                                                 rng_seed: int) -> None:
    """A KV pool too small for the batch (requests are preempted and recomputed), prefill in 8-token
    chunks, and (in a roomy pool) a second run of the same prompts served from the prefix cache,
    whose blocks hold verified tokens only: the same tokens."""
    directory = str(model_dirs[family])
    plain = LLM(directory, **BASE)
    batch = prompts(plain.engine.capabilities.vocab_size, rng_seed)
    want = [o.token_ids for o in plain.generate(batch, GREEDY)]
    small = {"engine.max_num_batched_tokens": 8, "engine.block_size": 4}
    kv = LLM(directory, **BASE, **small).engine.runner.kv
    tensors = {id(t): t for t in kv.layer_caches}.values()
    block_bytes = sum(t.numel() * t.element_size() for t in tensors) // kv.num_blocks
    longest = max_request_blocks(kv.groups.windows, 4, max(map(len, batch)) + GREEDY.max_tokens, 8)
    budget = (longest * 4 // 3 + 1) * block_bytes / 2**30  # the longest request fits, not all three
    tight = LLM(directory, **BASE, **NGRAM, **small, **{"engine.cpu_kv_cache_gib": budget})
    preempted = tight.generate(batch, GREEDY)
    assert [o.token_ids for o in preempted] == want
    assert sum(o.num_preemptions for o in preempted) > 0, "the pool was meant to be too small for the batch"
    roomy = LLM(directory, **BASE, **NGRAM, **small)
    assert [o.token_ids for o in roomy.generate(batch, GREEDY)] == want
    again = roomy.generate(batch, GREEDY)
    assert [o.token_ids for o in again] == want
    assert sum(o.num_cached_tokens for o in again) > 0


def test_bad_speculative_configs_fail_before_loading(model_dirs: dict[str, Path]) -> None:
    directory = str(model_dirs["llama"])
    with pytest.raises(ConfigError, match=r"no drafter named 'eagle9'.*ngram"):
        LLM(directory, **BASE, **{**NGRAM, "speculative.method": "eagle9"})
    lookup = {"speculative.prompt_lookup_min": 4, "speculative.prompt_lookup_max": 2}
    with pytest.raises(ConfigError, match=r"prompt_lookup_min \(4\) must be >= 1 and <= .*max \(2\)"):
        LLM(directory, **BASE, **{**NGRAM, **lookup})
    too_many = {**NGRAM, "speculative.num_speculative_tokens": 8}  # cpu_amx verifies up to 8 rows
    with pytest.raises(ConfigError, match="decode query length 9 exceeds the backend's 8"):
        LLM(directory, **{**BASE, "attention.backend": "cpu_amx"}, **too_many)

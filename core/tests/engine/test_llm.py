"""Engine invariants on a small random DeepSeek-V3 checkpoint (torch_ref attention, float32)."""

from __future__ import annotations

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.config import ConfigError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def llm(v3_dir) -> LLM:
    return LLM(v3_dir, backend="torch_ref", block_size=16, max_num_batched_tokens=48)


def test_batched_equals_single_for_greedy_and_seeded_sampling(llm: LLM) -> None:
    prompts = _prompts(0, (5, 30, 61))
    params = [GREEDY, SamplingParams(temperature=0.9, top_k=50, seed=11, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.2, top_p=0.9, seed=12, max_tokens=12, ignore_eos=True)]
    batched = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, batched, strict=True):
        assert llm.generate([prompt], p)[0].token_ids == out.token_ids


def test_prefix_cache_hit_gives_the_same_tokens_as_a_miss(v3_dir) -> None:
    shared = _prompts(1, (40,))[0]
    prompts = [shared + [7, 8, 9], shared + [1, 2]]
    cached = LLM(v3_dir, backend="torch_ref", block_size=16)
    uncached = LLM(v3_dir, backend="torch_ref", block_size=16, enable_prefix_caching=False)
    cached.generate([prompts[0]], GREEDY)
    hit = cached.generate([prompts[1]], GREEDY)[0]
    miss = uncached.generate([prompts[1]], GREEDY)[0]
    assert hit.num_cached_tokens == 32 and miss.num_cached_tokens == 0
    assert hit.token_ids == miss.token_ids


def test_preempted_request_gives_the_same_tokens(v3_dir) -> None:
    prompts = _prompts(2, (20, 24, 28))
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=24, ignore_eos=True)
    roomy = LLM(v3_dir, backend="torch_ref", block_size=16).generate(prompts, params)
    # 3 layers x 16 slots x 40 floats x 4 B = 7680 B per block: 9 blocks, fewer than the 3 x 4 needed
    tight = LLM(v3_dir, backend="torch_ref", block_size=16, cpu_kv_cache_gib=9 * 7680 / 2**30)
    assert tight.engine.runner.kv.num_blocks == 9
    squeezed = tight.generate(prompts, params)
    assert sum(o.num_preemptions for o in squeezed) > 0
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in roomy]


def test_logprobs_are_the_top_k_of_the_log_softmax(llm: LLM, v3_dir) -> None:
    prompt = _prompts(3, (9,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=4, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(v3_dir)).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
    expected = torch.log_softmax(logits.float(), -1).topk(4, dim=-1)
    assert out.logprobs is not None and len(out.logprobs) == 3
    for step, top in enumerate(out.logprobs):
        assert list(top) == expected.indices[step].tolist()
        assert torch.allclose(torch.tensor(list(top.values())), expected.values[step], atol=1e-4)
        assert out.token_ids[step] == expected.indices[step, 0]


def test_a_sampled_tokens_logprob_is_reported_even_outside_the_top_k(llm: LLM, v3_dir) -> None:
    """vLLM's semantics: each step's dict holds the top k and the token that was emitted."""
    prompt = _prompts(5, (9,))[0]
    params = SamplingParams(temperature=5.0, seed=2, max_tokens=12, logprobs=1, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(v3_dir)).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
    want = torch.log_softmax(logits.double(), -1)
    outside = 0
    for step, (token, top) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert token in top and abs(top[token] - want[step, token].item()) < 1e-4
        outside += len(top) == 2  # the sampled token was not the most likely one
    assert outside > 0, "temperature 5 was meant to sample some unlikely tokens"


def test_outputs_report_seed_timings_and_finish_reasons(llm: LLM) -> None:
    first, second = llm.generate(_prompts(4, (6, 6)), SamplingParams(max_tokens=4))
    assert first.seed != second.seed  # drawn from the engine generator (config sampler.seed)
    assert 0 < first.timings.time_to_first_token_s <= first.timings.total_s
    assert first.text is None  # this checkpoint has no tokenizer
    stop = llm.generate(_prompts(5, (6,)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    stopper = llm.generate(_prompts(5, (6,)), SamplingParams(temperature=0.0, max_tokens=4,
                                                              stop_token_ids=(stop.token_ids[1],)))[0]
    assert stopper.finish_reason == "stop" and stopper.token_ids == stop.token_ids[:2]


def test_bad_requests_fail_with_clear_errors(llm: LLM) -> None:
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["text prompt"], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 999]], GREEDY)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([[1, 2]], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 600], GREEDY)
    with pytest.raises(ValueError, match="exactly one of 'prompt' or 'prompt_token_ids'"):
        llm.generate([{"prompt_token_ids": [1, 2], "prompt": "x"}], GREEDY)


def test_vllm_dict_prompts_are_their_token_ids(llm: LLM) -> None:
    """{"prompt_token_ids": ids} (vLLM's TokensPrompt) gives what the ids give, alone and in a list."""
    ids = _prompts(11, (7, 4))
    want = [o.token_ids for o in llm.generate(ids, GREEDY)]
    got = llm.generate([{"prompt_token_ids": p} for p in ids], GREEDY)
    assert [o.token_ids for o in got] == want
    assert llm.generate({"prompt_token_ids": ids[0]}, GREEDY)[0].token_ids == want[0]


def test_bad_engine_configs_fail_before_loading(v3_dir) -> None:
    with pytest.raises(ConfigError, match="matches no config field"):
        LLM(v3_dir, not_a_field=1)
    with pytest.raises(ConfigError, match=r"dcp_size 2 must divide parallel.tensor_parallel_size 1"):
        LLM(v3_dir, dcp_size=2)
    with pytest.raises(ConfigError, match=r"started by torchrun \(`torchrun --nproc-per-node 2"):
        LLM(v3_dir, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="does not fit one block"):
        LLM(v3_dir, backend="torch_ref", cpu_kv_cache_gib=1e-9)
    with pytest.raises(ValueError, match="needs 6 KV blocks; the cache has 4"):
        LLM(v3_dir, backend="torch_ref", cpu_kv_cache_gib=4 * 7680 / 2**30).generate([[1] * 70], GREEDY)


def test_logit_bias_and_allowed_tokens_steer_generation(llm: LLM) -> None:
    prompt = _prompts(5, (9,))[0]
    favourite = int(torch.randint(0, 256, (1,)))
    biased = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={favourite: 1e4})
    assert llm.generate([prompt], biased)[0].token_ids == [favourite] * 6
    allowed = tuple(torch.randperm(256)[:3].tolist())
    for params in (
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed),
        SamplingParams(temperature=1.5, seed=4, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed),
    ):
        assert set(llm.generate([prompt], params)[0].token_ids) <= set(allowed)
    # greedy over the allowed set is the argmax of the raw logits restricted to it
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=320))[0]
    first = free.logprobs[0]
    restricted = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=allowed))[0]
    assert restricted.token_ids[0] == max(allowed, key=lambda t: first[t])


def test_bias_or_allowed_token_outside_the_vocab_fails_before_anything_runs(llm: LLM) -> None:
    for params in (SamplingParams(logit_bias={10_000: 1.0}), SamplingParams(allowed_token_ids=(1, 10_000))):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([[1, 2], [3, 4]], [GREEDY, params])
    assert not llm.engine.scheduler.has_work()


def test_bad_configs_fail_with_clear_errors(v3_dir) -> None:
    import dataclasses

    from jackfield.config import EngineConfig, JackfieldConfig

    hand_built = JackfieldConfig(engine=dataclasses.replace(EngineConfig(), max_num_seqs=0))
    with pytest.raises(ConfigError, match="engine.max_num_seqs must be > 0"):
        LLM(v3_dir, hand_built)
    with pytest.raises(ConfigError, match="no sampler named 'nope'"):
        LLM(v3_dir, backend="torch_ref", **{"sampler.name": "nope"})
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings"):
        LLM(v3_dir, backend="torch_ref", max_model_len=10**8)


def test_step_preparation_runs_on_one_thread_and_the_model_on_the_pool(v3_dir, monkeypatch) -> None:
    """The per-row index arithmetic runs single-threaded (see ops.staging.host_single_threaded);
    the forward, which does the real work on a CPU device, runs at the step's thread count (pinned
    to 2 here; engine/cpu_threads.py measures it otherwise)."""
    from jackfield.engine.model_runner import ModelRunner

    llm = LLM(v3_dir, backend="torch_ref", block_size=16, **{"engine.cpu_threads": 2})
    seen: dict[str, list[int]] = {"metadata": [], "logits": []}
    metadata, logits = ModelRunner._metadata, type(llm.engine.runner.model).compute_logits

    def spy_metadata(self, chunks):
        seen["metadata"].append(torch.get_num_threads())
        return metadata(self, chunks)

    def spy_logits(self, hidden):
        seen["logits"].append(torch.get_num_threads())
        return logits(self, hidden)

    monkeypatch.setattr(ModelRunner, "_metadata", spy_metadata)
    monkeypatch.setattr(type(llm.engine.runner.model), "compute_logits", spy_logits)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm.generate(_prompts(3, (5, 9)), GREEDY)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen["metadata"] and set(seen["metadata"]) == {1}
    assert seen["logits"] and set(seen["logits"]) == {2}



def test_an_unset_block_size_is_the_decode_backends_preferred_size(v3_dir) -> None:
    """Left unset, engine.block_size follows the chosen backend's preferred page size end to end
    (cpu_amx, which `auto` picks for MLA on x86 CPUs, pages in 64-key blocks; torch_ref has none)."""
    llm = LLM(v3_dir)
    preferred = llm.engine.backend_choices["decode"].backend.capabilities.preferred_block_size or 16
    assert llm.config.engine.block_size == preferred
    assert llm.engine.block_manager.block_size == preferred
    assert llm.engine.runner.kv.layer_caches[0].shape[1] == preferred
    out = llm.generate([[1, 2, 3]], GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_tokens

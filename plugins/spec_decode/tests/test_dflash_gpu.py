"""The `dflash` and `dspark` drafters on a GPU (bf16, a Llama target with a random draft): the context K/V and
the non-causal block through cuda_attn's kernels, CUDA graphs on for the target. Greedy tokens are
those of the run without drafts up to rounding; the drafts' distributions on cuda_attn are those
torch_ref gives on the same GPU while the tokens agree (a kernel that ignored the non-causal
metadata would draft from a causal block and part at once). cuda_mla serves MLA layers only: a
DeepSeek target on it refuses the draft's GQA layers, naming the backend."""

from __future__ import annotations

import pytest
import torch
from jackfield.testing.checks import greedy_runs_agree

pytestmark = pytest.mark.gpu

GPU_LLAMA = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)
SETTINGS = {"engine.device": "cuda", "model.dtype": "bfloat16", "engine.gpu_memory_fraction": 0.05,
            "engine.max_num_batched_tokens": 256}


Checkpoints = tuple[str, dict[str, object]]  # the target's directory, the [speculative] settings


@pytest.fixture(scope="module", params=["dflash", "dspark"])
def checkpoints(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Checkpoints:
    from jackfield.testing.checkpoints import write_granite
    from jackfield_spec_decode.testing import write_dflash

    root = tmp_path_factory.mktemp("gpu_dflash")
    write_granite("llama", root / "target", **GPU_LLAMA)
    method = request.param
    write_dflash(root / "draft", root / "target", 11, target_layer_ids=[1, 3, 5], mask_token_id=4095,
                 block_size=8, layers=2, heads=16, kv_heads=4, head_dim=64, intermediate=2048,
                 markov_rank=64 if method == "dspark" else 0)
    speculative = {"speculative.method": method, "speculative.num_speculative_tokens": 3,
                   "speculative.model": str(root / "draft")}
    return str(root / "target"), speculative


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (7, 130, 33)]


def test_dflash_greedy_tokens_match_the_run_without_drafts(checkpoints: Checkpoints) -> None:
    from jackfield import LLM, SamplingParams

    target, speculative = checkpoints
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=5, ignore_eos=True)
    backend = {"attention.backend": "cuda_attn"}
    plain = LLM(target, **SETTINGS, **backend).generate(_prompts(), params)
    spec = LLM(target, **SETTINGS, **backend, **speculative).generate(_prompts(), params)
    assert all(o.speculative is not None and o.speculative.drafts > 0 for o in spec)
    assert greedy_runs_agree(plain, spec) >= 20


def test_dflash_drafts_on_cuda_attn_equal_torch_refs(checkpoints: Checkpoints) -> None:
    from jackfield import LLM, SamplingParams

    target, speculative = checkpoints
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3)

    def drafts(backend: str, prompt: list[int]) -> list[tuple[list[int], torch.Tensor]]:
        engine = LLM(target, **SETTINGS, **speculative, **{"attention.backend": backend,
                                                            "engine.cuda_graphs": False}).engine
        seq = engine.add_request(prompt, params)
        steps = []
        while seq.finish_time is None:
            engine.step()
            if seq.draft_probs is not None:
                steps.append((list(seq.token_ids), seq.draft_probs.float().cpu()))
        return steps

    compared = 0
    for prompt in _prompts():
        pairs = zip(drafts("cuda_attn", prompt), drafts("torch_ref", prompt), strict=False)
        for (got_tokens, got), (want_tokens, want) in pairs:
            if got_tokens != want_tokens:  # a rounding difference drew another token: paths part
                break
            torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
            compared += 1
    assert compared >= 6


def test_dflash_on_cuda_mla_is_refused_naming_it(tmp_path_factory: pytest.TempPathFactory) -> None:
    from jackfield import LLM
    from jackfield.config import ConfigError
    from jackfield.testing.checkpoints import write_deepseek
    from jackfield_spec_decode.testing import write_dflash

    root = tmp_path_factory.mktemp("gpu_dflash_mla")
    write_deepseek("v3", root / "target", first_k_dense_replace=3)
    write_dflash(root / "draft", root / "target", 12, target_layer_ids=[0, 1], mask_token_id=7)
    with pytest.raises(ConfigError, match=r"the draft's attention layers .* cuda_mla serves MLA layers only"):
        LLM(str(root / "target"), **SETTINGS, **{
            "attention.backend": "cuda_mla", "speculative.method": "dflash",
            "speculative.num_speculative_tokens": 3, "speculative.model": str(root / "draft")})

"""The `mtp` drafter on a GPU with cuda_mla (bf16, DeepSeek's MLA head sizes): verify steps and the
MTP layer's own rows (multi-token decode rows, one-row draft steps) through the real kernels.
Drafts change only which rows a step computes, so greedy tokens are those of the run without
drafts up to rounding: every token's top-5 logprobs agree within bf16 noise while the tokens
agree, and where they part, it is at a near-tie of the run without drafts."""

from __future__ import annotations

import pytest
import torch
from jackfield.testing.checks import greedy_runs_agree

pytestmark = pytest.mark.gpu

GPU_DEEPSEEK = dict(
    vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
    num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=2048, initializer_range=0.02,
    first_k_dense_replace=4,  # every layer dense, the MTP layer (index 3) too: see below
)  # fmt: skip
# Dense layers only: a random MoE router has near-ties, so any change of rounding (a verify step's
# different row count included) can route a token to another expert and move logprobs by 0.1-0.2
# (docs/backends.md, cuda_mla); these comparisons are of the drafting paths, which a dense model
# isolates. (On the H200 the MoE version failed at a 0.14 difference with every token equal.)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    from jackfield.testing.checkpoints import write_deepseek_mtp

    directory = tmp_path_factory.mktemp("gpu_mtp")
    write_deepseek_mtp("v3", directory, **GPU_DEEPSEEK)
    return str(directory)


def _generate(checkpoint: str, prompts: list[list[int]], speculative: dict[str, object]) -> list:
    from jackfield import LLM, SamplingParams

    settings = {"attention.backend": "cuda_mla", "engine.device": "cuda", "model.dtype": "bfloat16",
                "engine.gpu_memory_fraction": 0.05, "engine.max_num_batched_tokens": 96}
    llm = LLM(checkpoint, **settings, **speculative)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, logprobs=5, ignore_eos=True))
    del llm
    torch.cuda.empty_cache()
    return outs


def test_mtp_greedy_tokens_match_the_run_without_drafts(checkpoint: str) -> None:
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (7, 130, 33)]
    plain = _generate(checkpoint, prompts, {})
    mtp = {"speculative.method": "mtp", "speculative.num_speculative_tokens": 3}
    spec = _generate(checkpoint, prompts, mtp)
    assert all(o.speculative is not None and o.speculative.drafts > 0 for o in spec)
    assert greedy_runs_agree(plain, spec) >= 20


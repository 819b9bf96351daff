"""cuda_mla inside the engine on a real GPU: first-token logprobs agree with torch_ref on the same
weights (the kernels' own tests use small caches; the engine's KV cache fills the GPU), and decode
steps replayed from CUDA graphs give the eager tokens. Both cache budgets are run.
"""

from __future__ import annotations

import pytest
import torch
from jackfield.testing.checks import greedy_runs_agree

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Dense layers only: a random MoE router has near-ties, so any change of rounding (bf16 vs
    float32 torch_ref alike) can route a token to another expert and move logprobs by 0.2; the
    comparisons here are of attention paths, which a dense model isolates (docs/backends.md)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=4096,
        hidden_size=1024,
        intermediate_size=2048,
        moe_intermediate_size=512,
        num_hidden_layers=3,
        first_k_dense_replace=3,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=384,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    directory = tmp_path_factory.mktemp("gpu_engine_v3")
    model.save_pretrained(str(directory))
    return str(directory)


def first_token_logprobs(
    checkpoint: str, backend: str, fraction: float, prompt: list[int]
) -> dict[int, float]:
    from jackfield import LLM, SamplingParams

    llm = LLM(
        checkpoint,
        **{
            "attention.backend": backend,
            "engine.device": "cuda",
            "model.dtype": "bfloat16",
            "engine.gpu_memory_fraction": fraction,
            "engine.block_size": 64,
            "engine.enable_prefix_caching": False,
        },
    )
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))[0]
    del llm
    torch.cuda.empty_cache()
    return out.logprobs[0]


@pytest.mark.parametrize("fraction", [0.02, 0.85], ids=["small-cache", "full-gpu-cache"])
def test_first_token_logprobs_match_torch_ref(checkpoint: str, fraction: float) -> None:
    prompt = torch.randint(0, 4096, (384,), generator=torch.Generator().manual_seed(1)).tolist()
    want = first_token_logprobs(checkpoint, "torch_ref", fraction, prompt)
    got = first_token_logprobs(checkpoint, "cuda_mla", fraction, prompt)
    common = set(want) & set(got)
    assert len(common) >= 4, (want, got)
    assert max(abs(want[t] - got[t]) for t in common) < 0.05, (want, got)


def test_insert_and_decode_in_a_cache_past_two_billion_elements() -> None:
    """Offsets past 2^31 elements (a large engine cache) must not wrap to 32 bits anywhere."""
    from jackfield_cuda_mla.kernels import mla_decode, mla_kv_insert

    blocks, page, width, rank = 240_000, 16, 576, 512  # 2.2e9 elements, 4.4 GB of bf16
    cache = torch.empty(blocks, page, width, dtype=torch.bfloat16, device="cuda")
    tokens = 48
    slots = torch.cat([torch.arange(16), (blocks - 2) * page + torch.arange(32)]).cuda()
    kv_c = torch.randn(tokens, rank, device="cuda", dtype=torch.bfloat16)
    k_pe = torch.randn(tokens, width - rank, device="cuda", dtype=torch.bfloat16)
    mla_kv_insert(kv_c, k_pe, cache, slots)
    assert torch.equal(cache.view(-1, width)[slots], torch.cat([kv_c, k_pe], dim=1))
    # one request whose pages are the last two blocks (offsets past 2^31 elements)
    query = torch.randn(1, 16, width, device="cuda", dtype=torch.bfloat16)
    table = torch.tensor([[blocks - 2, blocks - 1]], dtype=torch.int32, device="cuda")
    out, lse = mla_decode(
        query,
        cache,
        table,
        torch.tensor([32], dtype=torch.int32, device="cuda"),
        torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
        max_query_len=1,
        max_seq_len=32,
        sm_scale=width**-0.5,
        kv_lora_rank=rank,
        causal=True,
    )
    keys = cache.view(-1, width)[slots[16:]].double()
    scores = query[0].double() @ keys.T * width**-0.5
    want = torch.softmax(scores, dim=-1) @ keys[:, :rank]
    assert (out[0].double() - want).abs().max() < 2e-2
    assert (lse[0].double() - torch.logsumexp(scores, dim=-1)).abs().max() < 1e-2


def _generate(
    checkpoint: str, graphs: bool, prompts: list[list[int]], params: list, step_tokens: int
) -> list:
    from jackfield import LLM

    llm = LLM(
        checkpoint,
        **{
            "attention.backend": "cuda_mla",
            "engine.device": "cuda",
            "model.dtype": "bfloat16",
            "engine.gpu_memory_fraction": 0.05,
            "engine.cuda_graphs": graphs,
            "engine.max_num_seqs": 16,
            "engine.max_num_batched_tokens": step_tokens,
        },
    )
    assert (llm.engine.runner.decode_graphs_off is None) == graphs, llm.engine.runner.decode_graphs_off
    assert (llm.engine.runner.prefill_graphs_off is None) == graphs, llm.engine.runner.prefill_graphs_off
    outs = llm.generate(prompts, params)
    del llm
    torch.cuda.empty_cache()
    return outs


@pytest.mark.parametrize("step_tokens", [2048, 96], ids=["whole-prompts", "chunked-mixed-steps"])
def test_replayed_steps_match_the_eager_steps(checkpoint: str, step_tokens: int) -> None:
    """Requests of different lengths finishing at different steps (batches 5, 4, 2, 1 replayed in
    the decode graphs of 8, 4, 2, 1; prefills, and with a 96-token step budget chunked prefills
    mixed with decodes, replayed in the prefill pieces of 16..2048 tokens). Replay and eager
    steps differ only in rounding (padded rows change matmul shapes; the graph's split-KV plan is
    made for max_model_len), so: every step's top-5 logprobs agree within bf16 noise while the
    tokens agree, and where greedy tokens part, it is at a near-tie of the eager step (then the
    continuations are different texts, not compared)."""
    from jackfield import SamplingParams

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (7, 64, 130, 301, 33)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, logprobs=5, ignore_eos=True) for n in (24, 9, 24, 17, 3)
    ]
    eager, replayed = (
        _generate(checkpoint, graphs, prompts, params, step_tokens) for graphs in (False, True)
    )
    assert greedy_runs_agree(eager, replayed) >= 25

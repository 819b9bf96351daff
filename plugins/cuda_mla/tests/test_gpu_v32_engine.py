"""DeepSeek-V3.2 (lightning indexer + sparse MLA) inside the engine on a GPU through cuda_mla,
against transformers' DeepseekV32ForCausalLM on the same GPU. Prompts are longer than index_topk,
so every query attends to a chosen subset of its keys:
- first-token top-5 logprobs of the engine in bf16 stay as close to transformers float32 as
  transformers' own bf16 run does (bounded by that run's error, measured here), while attending
  to every key instead (transformers with index_topk past the prompt) is much further away;
- greedy decode replayed from CUDA graphs gives the eager engine's steps."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
from jackfield.testing.checks import greedy_runs_agree

pytestmark = pytest.mark.gpu

INDEX_TOPK = 128
# DeepSeek's attention shapes (kv_lora_rank 512 + rope 64); dense MLPs, since a random router's
# near-ties would move a token to another expert at any change of rounding
V32_GPU = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
               num_hidden_layers=3, first_k_dense_replace=3, num_attention_heads=16,
               num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=8, n_shared_experts=1,
               num_experts_per_tok=2, n_group=2, topk_group=1, index_n_heads=16, index_head_dim=128,
               max_position_embeddings=2048)  # fmt: skip
SETTINGS = {"attention.backend": "cuda_mla", "engine.device": "cuda", "model.dtype": "bfloat16",
            "engine.gpu_memory_fraction": 0.05, "engine.enable_prefix_caching": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from jackfield.testing.checkpoints import write_deepseek_v32

    directory = tmp_path_factory.mktemp("gpu_v32")
    write_deepseek_v32(directory, INDEX_TOPK, seed=7, **V32_GPU)
    return directory


def _prompts(seed: int) -> list[list[int]]:
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (300, 457, 512, 389)]


def _transformers_logprobs(checkpoint: Path, prompts: list[list[int]], dtype: torch.dtype,
                           index_topk: int = INDEX_TOPK) -> list[torch.Tensor]:
    from transformers import DeepseekV32ForCausalLM

    model = DeepseekV32ForCausalLM.from_pretrained(checkpoint, dtype=dtype).cuda().eval()
    for module in model.modules():  # where the indexer reads its top-k (the config, or a copy of it)
        if hasattr(module, "index_topk"):
            module.index_topk = index_topk
    model.config.index_topk = index_topk
    out = []
    with torch.no_grad():
        for prompt in prompts:
            logits = model(torch.tensor([prompt], device="cuda")).logits[0, -1]
            out.append(logits.double().log_softmax(-1).cpu())
    del model
    torch.cuda.empty_cache()
    return out


def _top5_gap(reference: torch.Tensor, logprobs: dict[int, float] | torch.Tensor) -> float:
    """max |difference| over the top 5 tokens of `logprobs` (a dict: the engine's; a tensor: all)."""
    if isinstance(logprobs, torch.Tensor):
        top = logprobs.topk(5).indices.tolist()
        return max(abs(float(logprobs[t] - reference[t])) for t in top)
    return max(abs(value - float(reference[token])) for token, value in logprobs.items())


def test_engine_bf16_is_as_close_to_transformers_float32_as_its_bf16(checkpoint: Path, rng_seed: int) -> None:
    from jackfield import LLM, SamplingParams

    prompts = _prompts(rng_seed)
    want = _transformers_logprobs(checkpoint, prompts, torch.float32)
    hf_bf16 = _transformers_logprobs(checkpoint, prompts, torch.bfloat16)
    dense = _transformers_logprobs(checkpoint, prompts, torch.float32, index_topk=4096)
    llm = LLM(str(checkpoint), **SETTINGS)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=5), use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    ours = [_top5_gap(w, o.logprobs[0]) for w, o in zip(want, outs, strict=True)]
    theirs = [_top5_gap(w, b) for w, b in zip(want, hf_bf16, strict=True)]
    every_key = [_top5_gap(w, d) for w, d in zip(want, dense, strict=True)]
    print(f"top-5 gaps to transformers float32: engine bf16 {ours}, transformers bf16 {theirs}, "
          f"dense attention {every_key}")
    noise = statistics.median(theirs)
    assert statistics.median(ours) <= 2.0 * noise + 0.02, (ours, theirs)
    assert min(every_key) > 3 * max(statistics.median(ours), noise), "the prompts do not test sparsity"


def test_replayed_decode_gives_the_eager_steps(checkpoint: Path, rng_seed: int) -> None:
    from jackfield import LLM, SamplingParams

    prompts = [p[:n] for p, n in zip(_prompts(rng_seed), (150, 300, 9, 200), strict=True)]
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=5, ignore_eos=True)
    runs = []
    for graphs in (False, True):
        llm = LLM(str(checkpoint), **SETTINGS, **{"engine.cuda_graphs": graphs})
        if graphs:
            assert llm.engine.runner.graphs is not None, llm.engine.runner.decode_graphs_off
        runs.append(llm.generate(prompts, params, use_tqdm=False))
        del llm
        torch.cuda.empty_cache()
    assert greedy_runs_agree(runs[0], runs[1]) >= 40

"""fp8 KV caches inside the engine on a GPU: cuda_mla (DeepSeek-V3 shapes) and cuda_attn (Llama
shapes), bf16 activations, the scales calibrated from the first prefill.

The CPU tests (core/tests/engine/test_fp8_kv_cache.py) pin the fp8 arithmetic against transformers
exactly; here the GPU kernels (fp8 KV insert, fp8 decode, prefill over the fp8 cache) run inside
the engine: the logprob error against float32 is bounded, greedy agreement with the bf16 cache is
printed, decode and prefill steps replayed from CUDA graphs (recorded before the scales were
calibrated: kernels read them by address) agree with eager steps, and a prefix-cache hit reads
the fp8 blocks a miss recomputes.

  pytest tests/test_gpu_fp8_engine.py -s    # -s: the agreement and error lines
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from jackfield.testing.fp8_reference import float64_logits, fp8_reference
from transformers import PreTrainedModel

pytestmark = pytest.mark.gpu

FIRST_TOKEN = dict(temperature=0.0, max_tokens=1, logprobs=5)
LENGTHS = (64, 300, 700, 1500)


@dataclass(frozen=True)
class Case:
    backend: str
    directory: Path
    model: PreTrainedModel  # float32 holding the checkpoint's bf16 values: the references' weights


def build(backend: str, directory: Path) -> PreTrainedModel:
    """Dense models (a random MoE router's near-ties move logprobs far more than fp8 rounding),
    in shapes the backends' kernels take; saved in bf16, returned in float32 with those values."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

    if backend == "cuda_mla":
        config = DeepseekV3Config(
            vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
            num_hidden_layers=3, first_k_dense_replace=3, num_attention_heads=16, num_key_value_heads=16,
            q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
            max_position_embeddings=4096,
        )  # fmt: skip
        model_cls = DeepseekV3ForCausalLM
    else:
        config = LlamaConfig(
            vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
            num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
        )  # fmt: skip
        model_cls = LlamaForCausalLM
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_cls(config).eval()
    model.to(torch.bfloat16).save_pretrained(str(directory))
    # Loaded back rather than `model.float()`: the cast rounded the RoPE frequency buffers to
    # bf16, which from_pretrained recomputes in float32 (the engine's frequencies).
    return model_cls.from_pretrained(str(directory), dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=["cuda_mla", "cuda_attn"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    directory = tmp_path_factory.mktemp(request.param)
    return Case(request.param, directory, build(request.param, directory))


def engine(case: Case, **settings: object):  # type: ignore[no-untyped-def]
    from jackfield import LLM

    return LLM(case.directory, **{
        "attention.backend": case.backend,
        "attention.kv_cache_dtype": "fp8_e4m3",
        "engine.device": "cuda",
        "model.dtype": "bfloat16",
        "engine.gpu_memory_fraction": 0.05,
        "engine.max_num_seqs": 16,
        **settings,
    })


def release_memory() -> None:
    """After `del llm`: the engine's cache and graph pools go back before the next engine starts."""
    gc.collect()
    torch.cuda.empty_cache()


def prompts(case: Case, lengths: tuple[int, ...]) -> list[list[int]]:
    """Token ids from the test's seed (rng_seed seeds torch's generator)."""
    return [torch.randint(0, case.model.config.vocab_size, (n,)).tolist() for n in lengths]


def mean_error(outputs: list, references: list[torch.Tensor]) -> float:
    """Mean |logprob - reference| over each output's top-5 first tokens."""
    errors = [abs(value - float(ref[token])) for out, ref in zip(outputs, references, strict=True)
              for token, value in out.logprobs[0].items()]
    return sum(errors) / len(errors)


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """Mean over requests of the share of greedy tokens before the first that differs."""
    shares = [next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), len(w)) / len(w)
              for g, w in zip(got, want, strict=True)]
    return sum(shares) / len(shares)


def test_fp8_logprob_error_against_float32_and_greedy_agreement_with_bf16(case: Case) -> None:
    """Per token, |fp8 run - float64| <= |fp8 run - float64 rounding the KV the same way| +
    |that rounding's own effect|. The second term is computed exactly (transformers rounding its
    KV with the run's scales); the first is the bf16 arithmetic of the engine, which the same
    engine with a bf16 cache shows (its error against float64), allowed twice (a bf16-computed
    value near an fp8 rounding boundary can round to the other neighbour: more error of the
    same kind)."""
    from jackfield import SamplingParams

    texts = prompts(case, LENGTHS)
    first, greedy, scales = {}, {}, None
    for kv_dtype in ("auto", "fp8_e4m3"):
        llm = engine(case, **{"attention.kv_cache_dtype": kv_dtype})
        first[kv_dtype] = llm.generate(texts, SamplingParams(**FIRST_TOKEN))  # fp8: calibrates here
        greedy[kv_dtype] = [o.token_ids for o in llm.generate(
            texts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))]
        if kv_dtype == "fp8_e4m3":
            summary = llm.engine.kv_cache_summary()
            assert summary["scale_source"] == "calibration"
            scales = summary["scales"]
        del llm
        release_memory()
    plain = [torch.log_softmax(float64_logits(case.model, t)[-1], dim=-1) for t in texts]
    rounded = [torch.log_softmax(fp8_reference(case.model, t, scales).logits[-1], dim=-1) for t in texts]
    bf16_error, fp8_error = mean_error(first["auto"], plain), mean_error(first["fp8_e4m3"], plain)
    tokens = [list(out.logprobs[0]) for out in first["fp8_e4m3"]]  # the fp8 run's top 5
    rounding = sum(abs(float(r[t]) - float(p[t])) for top, r, p in zip(tokens, rounded, plain, strict=True)
                   for t in top) / sum(len(top) for top in tokens)
    print(f"{case.backend}: mean |first-token logprob error| vs float64, bf16 cache {bf16_error:.4f}, fp8 "
          f"{fp8_error:.4f} (fp8 rounding alone {rounding:.4f}); greedy agreement of fp8 with bf16 "
          f"{agreement(greedy['fp8_e4m3'], greedy['auto']):.0%} of 32 tokens")
    assert fp8_error <= 2 * bf16_error + rounding, (fp8_error, bf16_error, rounding)


@pytest.mark.parametrize("step_tokens", [2048, 96], ids=["whole-prompts", "chunked-mixed-steps"])
def test_fp8_steps_replayed_from_cuda_graphs_match_eager_steps(case: Case, step_tokens: int) -> None:
    """As test_gpu_engine's bf16 comparison: batches of decodes replayed in the decode graphs,
    prefills (and chunked prefills mixed with decodes) in the prefill pieces. The graphs were
    recorded with the placeholder scales: a replay that did not read the calibrated ones would
    be far off. Replay and eager steps differ in rounding only: top-5 logprobs within bf16 noise
    while the tokens agree; where greedy tokens part, it is at a near-tie of the eager step."""
    from jackfield import SamplingParams

    texts = prompts(case, (7, 64, 130, 301, 33))
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=5, ignore_eos=True)
              for n in (24, 9, 24, 17, 3)]
    runs, scales = [], []
    for graphs in (False, True):
        llm = engine(case, **{"engine.cuda_graphs": graphs, "engine.max_num_batched_tokens": step_tokens})
        assert (llm.engine.runner.decode_graphs_off is None) == graphs, llm.engine.runner.decode_graphs_off
        runs.append(llm.generate(texts, params))
        scales.append(torch.tensor(llm.engine.kv_cache_summary()["scales"]))
        del llm
        release_memory()
    # the same first step calibrates both (bf16 values: equal, or a rounding apart)
    torch.testing.assert_close(scales[1], scales[0], rtol=2e-2, atol=0)
    compared = 0
    for want, got in zip(*runs, strict=True):
        for step, (w_tok, g_tok, w_lp, g_lp) in enumerate(
            zip(want.token_ids, got.token_ids, want.logprobs, got.logprobs, strict=True)
        ):
            if w_tok != g_tok:
                assert g_tok in w_lp and w_lp[w_tok] - w_lp[g_tok] < 0.05, (step, w_lp, g_lp)
                break
            common = set(w_lp) & set(g_lp)
            assert len(common) >= 4, (step, w_lp, g_lp)
            assert max(abs(w_lp[t] - g_lp[t]) for t in common) < 0.05, (step, w_lp, g_lp)
            compared += 1
    assert compared >= 25


def test_fp8_prefix_cache_hit_matches_a_miss(case: Case) -> None:
    """Both engines calibrate on the same first request; then the hit reads that request's fp8
    blocks and the miss recomputes them: the first-token logprobs agree within bf16 noise."""
    from jackfield import SamplingParams

    shared = prompts(case, (300,))[0]
    first, second = shared + prompts(case, (5,))[0], shared + prompts(case, (9,))[0]
    outs = {}
    for caching in (True, False):
        llm = engine(case, **{"engine.enable_prefix_caching": caching})
        llm.generate([first], SamplingParams(**FIRST_TOKEN))
        outs[caching] = llm.generate([second], SamplingParams(**FIRST_TOKEN))[0]
        del llm
        release_memory()
    hit, miss = outs[True], outs[False]
    assert hit.num_cached_tokens >= 256 and miss.num_cached_tokens == 0  # 300 shared: whole blocks of 64
    common = set(hit.logprobs[0]) & set(miss.logprobs[0])
    assert len(common) >= 4, (hit.logprobs, miss.logprobs)
    assert max(abs(hit.logprobs[0][t] - miss.logprobs[0][t]) for t in common) < 0.05

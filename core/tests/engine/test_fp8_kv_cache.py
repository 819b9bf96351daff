"""fp8 KV caches through the whole engine on the CPU (torch_ref), MLA (DeepSeek-V3) and MHA (Llama).

The references are transformers' own models: float32 for the error fp8 costs, and float64 with each
layer's KV rounded through fp8 by the engine's scales (jackfield.testing.fp8_reference) for what
the engine must compute exactly: the calibrated scales (amax / 448 of the KV the first prefill
writes), and logprobs with checkpoint scales. Prefix-cache hits and preempted requests give the
tokens of a plain run. A broken variant (scale ignored, applied twice, calibrated wrong) fails.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.attention import mla as mla_module
from jackfield.attention import torch_ref
from jackfield.models import attention as attention_module
from jackfield.testing.checkpoints import write_deepseek, write_granite
from jackfield.testing.fp8_reference import float64_logits, fp8_reference, round_fp8
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

FP8 = {"backend": "torch_ref", "kv_cache_dtype": "fp8_e4m3", "block_size": 4}
FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@dataclass(frozen=True)
class Family:
    name: str
    directory: Path
    model: PreTrainedModel  # float32, eager: transformers' own
    mla: bool


@pytest.fixture(scope="module", params=["deepseek", "llama"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    """Dense models: a random MoE router has near-ties, and a token routed to another expert moves
    logprobs by far more than fp8's rounding (docs/backends.md); the KV cache is what is tested."""
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "deepseek":
        model = write_deepseek("v3", directory, seed=3, first_k_dense_replace=3)
    else:
        model = write_granite("llama", directory, seed=1)
    return Family(request.param, directory, model, request.param == "deepseek")


def random_prompts(family: Family, lengths: tuple[int, ...]) -> list[list[int]]:
    """Token ids from the test's seed (rng_seed seeds torch's generator)."""
    return [torch.randint(0, family.model.config.vocab_size, (n,)).tolist() for n in lengths]


def engine_scales(llm: LLM) -> list[list[float]]:
    """Per fp8 layer, its scales as the engine holds them ([record] MLA, [key, value] MHA)."""
    scales = llm.engine.kv_cache_summary()["scales"]
    assert isinstance(scales, list)
    return scales


def amax_scales(family: Family, prompts: list[list[int]], scales: list[list[float]]) -> list[list[float]]:
    """amax / 448 per layer of the float64 KV the prompts write, each layer rounding with `scales`
    before the next reads it (as the engine's calibrating prefill does)."""
    kv = [fp8_reference(family.model, prompt, scales).kv for prompt in prompts]
    out = []
    for layer in range(len(scales)):
        key = max(float(ref[layer][0].abs().max()) for ref in kv)
        value = max(float(ref[layer][1].abs().max()) for ref in kv)
        out.append([max(key, value) / 448] if family.mla else [key / 448, value / 448])
    return out


def test_calibrated_scales_are_amax_over_448_of_the_first_prefill(family: Family) -> None:
    llm = LLM(family.directory, **FP8)
    before = llm.engine.kv_cache_summary()
    assert before["scale_source"] == "calibration" and before["scales"] is None  # nothing ran yet
    prompts = random_prompts(family, (13, 21))  # one step: the whole first prefill
    llm.generate(prompts, GREEDY)
    scales = engine_scales(llm)
    amax = amax_scales(family, prompts, scales)
    assert len(scales) == len(amax) == family.model.config.num_hidden_layers
    got, want = torch.tensor(scales, dtype=torch.float64), torch.tensor(amax, dtype=torch.float64)
    # layer 0 reads no attention: float32 arithmetic against float64, a few float32 roundings
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=0)
    # later layers also see the fp8 KV of earlier ones, where a float32 value within float32
    # rounding of an fp8 midpoint may round the other way: far below 1e-3 of an amax (a scale
    # off by a power of two, or taken over other rows, is far above)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=0)
    llm.generate(random_prompts(family, (30,)), GREEDY)
    assert engine_scales(llm) == scales, "the scales moved after the first prefill (they are frozen)"


def test_logprobs_equal_transformers_with_the_same_fp8_rounding(family: Family) -> None:
    """The engine computes transformers' forward over KV rounded by its scales."""
    llm = LLM(family.directory, **FP8)
    prompts = random_prompts(family, (9, 17, 30))
    outputs = llm.generate(prompts, FIRST_TOKEN)
    assert_matches_fp8_reference(family, prompts, outputs, engine_scales(llm))


def assert_matches_fp8_reference(family: Family, prompts: list[list[int]], outputs: list,
                                 scales: list[list[float]]) -> None:
    """Top-5 first-token logprobs within 1e-4 (float32 against float64 over logprobs of a few
    nats) plus a tenth of what fp8's rounding moves them: a float32 value within float32 rounding
    of an fp8 midpoint can round to the other neighbour (one element moves one fp8 step), which
    moves the result by a small part of what the rounding of every element does. Rounding with
    other scales, or misreading them, moves it by about all of that or more."""
    for prompt, out in zip(prompts, outputs, strict=True):
        want = torch.log_softmax(fp8_reference(family.model, prompt, scales).logits[-1], dim=-1)
        unrounded = torch.log_softmax(float64_logits(family.model, prompt)[-1], dim=-1)
        got = out.logprobs[0]
        tokens = list(got)  # the engine's top 5 (the reference's, up to near-ties)
        rounding = float((want[tokens] - unrounded[tokens]).abs().max())
        torch.testing.assert_close(torch.tensor(list(got.values()), dtype=torch.float64), want[tokens],
                                   rtol=0, atol=1e-4 + 0.1 * rounding)


def logprob_error(family: Family, llm: LLM, prompts: list[list[int]]) -> float:
    """Mean |logprob - float32 transformers'| over the top 5 first tokens of each prompt."""
    errors = []
    for prompt, out in zip(prompts, llm.generate(prompts, FIRST_TOKEN), strict=True):
        with torch.no_grad():
            want = torch.log_softmax(family.model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        errors += [abs(value - float(want[token])) for token, value in out.logprobs[0].items()]
    return sum(errors) / len(errors)


def agreement(got: list[int], want: list[int]) -> float:
    """The share of greedy tokens before the first that differs."""
    same = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want))
    return same / len(want)


def test_logprob_error_against_float32_is_within_fp8_precision(family: Family) -> None:
    """The bound comes from the formats, not from a measurement of this model: e4m3 keeps 3
    mantissa bits, bf16 7, so rounding a value to fp8 errs 2^-4 / 2^-8 = 16x as much (relative,
    round to nearest) as rounding it to bf16. Errors this small propagate linearly, so a run with
    an fp8 cache errs against float32 about 16x as much as the same run with a bf16 cache (float32
    activations both: the cache is the only rounding). Allowed: 2 x 16 over 16 prompts' 80
    |errors| (the mean of 4 prompts' 20 spread to 33x for one seed). Greedy agreement with float32
    is printed."""
    prompts = random_prompts(family, (9, 17, 30, 45) * 4)
    engines = {dtype: LLM(family.directory, **{**FP8, "kv_cache_dtype": dtype})
               for dtype in ("fp8_e4m3", "bfloat16", "auto")}
    error = {dtype: logprob_error(family, llm, prompts) for dtype, llm in engines.items()}
    greedy = {dtype: [o.token_ids for o in llm.generate(prompts, GREEDY)] for dtype, llm in engines.items()}
    for dtype in ("fp8_e4m3", "bfloat16"):
        shares = [agreement(g, w) for g, w in zip(greedy[dtype], greedy["auto"], strict=True)]
        print(f"{family.name} {dtype} cache: mean |logprob error| vs float32 {error[dtype]:.2e}, greedy "
              f"agreement with the float32 cache {sum(shares) / len(shares):.0%} of "
              f"{GREEDY.max_tokens} tokens")
    assert error["auto"] < 1e-4  # the float32 engine is transformers' float32 model
    assert 0 < error["fp8_e4m3"] <= 2 * 16 * error["bfloat16"], error


def with_checkpoint_scales(family: Family, directory: Path, scales: list[list[float]]) -> None:
    """A copy of the family's checkpoint with per-layer fp8 scales beside the attention weights:
    DeepSeek k_scale (and a v_scale and q_scale nothing may use), Llama ModelOpt's names."""
    shutil.copytree(family.directory, directory)
    (weights,) = directory.glob("*.safetensors")
    tensors = load_file(str(weights))
    for i, layer in enumerate(scales):
        attn = f"model.layers.{i}.self_attn"
        if family.mla:
            tensors[f"{attn}.k_scale"] = torch.tensor(layer[0])
            tensors[f"{attn}.v_scale"] = torch.tensor(layer[0] * 100)
            tensors[f"{attn}.q_scale"] = torch.tensor(-1.0)
        else:
            tensors[f"{attn}.k_proj.k_scale"] = torch.tensor(layer[0])
            tensors[f"{attn}.v_proj.v_scale"] = torch.tensor(layer[1])
    save_file(tensors, str(weights), metadata={"format": "pt"})


def test_checkpoint_scales_are_read_and_used(family: Family, tmp_path: Path) -> None:
    """Scales 2-4x the calibrated ones (so a run that calibrated instead would differ): reported
    as the checkpoint's, held in the cache (stored bytes = fp8(kv / scale)), and the logprobs are
    those of transformers rounding with them."""
    calibrating = LLM(family.directory, **FP8)
    prompts = random_prompts(family, (11, 19))
    calibrating.generate(prompts, FIRST_TOKEN)
    factors = torch.empty(len(engine_scales(calibrating))).uniform_(2, 4).tolist()
    chosen = [[torch.tensor(s * f).item() for s in layer]  # float32, as stored
              for layer, f in zip(engine_scales(calibrating), factors, strict=True)]
    with_checkpoint_scales(family, tmp_path / "scaled", chosen)
    llm = LLM(tmp_path / "scaled", **FP8, enable_prefix_caching=False)
    summary = llm.engine.kv_cache_summary()
    assert summary["scale_source"] == "checkpoint" and engine_scales(llm) == chosen
    outputs = llm.generate(prompts[:1], FIRST_TOKEN)
    assert_matches_fp8_reference(family, prompts[:1], outputs, chosen)
    # The first prompt's KV in layer 0's cache: its slots are the first ones of blocks 0.. (a fresh pool)
    cache = llm.engine.runner.kv_caches[0]
    reference = fp8_reference(family.model, prompts[0], chosen).kv[0]
    rows = len(prompts[0])
    if family.mla:
        stored = cache.flatten(0, 1)[:rows].double()
        want = torch.cat(reference, dim=-1) / chosen[0][0]
    else:
        stored = cache.flatten(1, 2)[:, :rows].double()
        want = torch.stack([reference[0] / chosen[0][0], reference[1] / chosen[0][1]])
    exact = stored == round_fp8(want, 1.0)
    assert float(exact.float().mean()) > 0.99, "the cache does not hold fp8(kv / checkpoint scale)"


def test_prefix_cache_hit_and_preemption_give_the_tokens_of_a_plain_run(family: Family) -> None:
    """Every engine calibrates on the same first step, then: a prefix-cache hit reads the fp8
    blocks a miss recomputes; a preempted request recomputes its KV with the frozen scales."""
    shared = random_prompts(family, (24,))[0]
    first, second = shared + [1, 2, 3], shared + [4, 5]
    cached = LLM(family.directory, **FP8)
    uncached = LLM(family.directory, **FP8, enable_prefix_caching=False)
    for llm in (cached, uncached):
        llm.generate([first], GREEDY)
    assert engine_scales(cached) == engine_scales(uncached)
    hit, miss = cached.generate([second], GREEDY)[0], uncached.generate([second], GREEDY)[0]
    assert hit.num_cached_tokens == 24 and miss.num_cached_tokens == 0
    assert hit.token_ids == miss.token_ids

    prompts = random_prompts(family, (20, 24, 28))
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=24, ignore_eos=True)
    pages = {**FP8, "block_size": 16}  # the first step (6 blocks) fits 9 blocks, the requests (10) do not
    roomy = LLM(family.directory, **pages)
    caches = {t.data_ptr(): t for t in roomy.engine.runner.kv_caches}.values()
    block_bytes = sum(t.numel() * t.element_size() for t in caches) // roomy.engine.runner.kv.num_blocks
    tight = LLM(family.directory, **pages, cpu_kv_cache_gib=9 * block_bytes / 2**30)
    assert tight.engine.runner.kv.num_blocks == 9
    plain, squeezed = roomy.generate(prompts, params), tight.generate(prompts, params)
    assert engine_scales(roomy) == engine_scales(tight)  # all three prompts fit the first step
    assert sum(o.num_preemptions for o in squeezed) > 0
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in plain]


# ---- broken variants: each must fail the test meant for it ------------------------------------

@pytest.fixture
def broken_dequantize(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch_ref (and the MLA prefill) reading fp8 values with the scale ignored or applied twice."""
    ignored = request.param == "scale ignored"

    def dequantize(x: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != torch.float8_e4m3fn:
            return x.float()
        assert kv_scale is not None
        return x.float() if ignored else x.float() * kv_scale.reshape(()) ** 2

    monkeypatch.setattr(torch_ref, "dequantize", dequantize)
    monkeypatch.setattr(mla_module, "dequantize", dequantize)
    yield


@pytest.mark.parametrize("broken_dequantize", ["scale ignored", "scale applied twice"], indirect=True)
@pytest.mark.usefixtures("broken_dequantize")
def test_a_broken_scale_fails_the_error_bound_and_the_reference(family: Family) -> None:
    with pytest.raises(AssertionError):
        test_logprob_error_against_float32_is_within_fp8_precision(family)
    with pytest.raises(AssertionError):
        test_logprobs_equal_transformers_with_the_same_fp8_rounding(family)


def test_a_wrong_calibration_fails(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    """amax / 224 (half the fp8 range, as a headroom divisor would give) is not the calibration."""
    calibrated = attention_module.calibrated_kv_scale
    monkeypatch.setattr(attention_module, "calibrated_kv_scale",
                        lambda key, value, mla: calibrated(key, value, mla) * 2)
    with pytest.raises(AssertionError):
        test_calibrated_scales_are_amax_over_448_of_the_first_prefill(family)

"""config.json fields that transformers reads with its own precedence (issue 23, class 8).

Honoured fields: checkpoints whose fields disagree (explicit head_dim against hidden_size / heads,
legacy rope_scaling + rope_theta against rope_parameters, a window without layer_types, ...),
written by transformers' own config classes with seeded random weights; the engine's greedy tokens
and the model's float32 logits must equal transformers'. Refused fields: doctor and run both name
the field before anything loads (docs/models.md has the whole audit)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.cli import main
from jackfield.config import ConfigError
from jackfield.models import load_model
from jackfield.models.hf_config import check_builtin_family, deepseek_arch, read_hf_config
from jackfield.testing.checkpoints import (
    DEEPSEEK,
    DEEPSEEK_CONSTANTS,
    DEEPSEEK_V32,
    GRANITE_CONSTANTS,
    GRANITE_MOE,
    GRANITE_MULTIPLIERS,
    LLAMA,
    greedy_reference,
    write_model,
)
from jackfield.testing.paged import TORCH_REF, assert_generates_like_transformers
from transformers import (
    DeepseekV2Config,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV32Config,
    GraniteConfig,
    GraniteForCausalLM,
    GraniteMoeConfig,
    GraniteSWAConfig,
    GraniteSWAForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
SEED = random.randrange(2**31)
print(f"test_hf_config_precedence seed {SEED}")  # weights and prompts below are drawn from it

# RoPE settings over a short original context (16), so prompts of 12-20 tokens reach the scaled bands.
LLAMA3 = dict(rope_type="llama3", rope_theta=5000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16)


def prompts(vocab_size: int) -> list[list[int]]:
    gen = random.Random(SEED)
    return [[gen.randrange(vocab_size) for _ in range(gen.randint(12, 20))] for _ in range(2)]


def rewrite_config(path: Path, change: Callable[[dict[str, object]], None]) -> None:
    config_json = path / "config.json"
    data = json.loads(config_json.read_text())
    change(data)
    config_json.write_text(json.dumps(data))


def legacy_rope(data: dict[str, object]) -> None:
    """rope_parameters written the way pre-5 checkpoints carry it: rope_scaling ("type") + rope_theta."""
    params = dict(data.pop("rope_parameters"))  # type: ignore[call-overload]
    data["rope_theta"] = params.pop("rope_theta")
    rope_type = params.pop("rope_type")
    if rope_type != "default":
        data["rope_scaling"] = {"type": rope_type, **params}


def assert_engine_and_model_match(reference: PreTrainedModel, path: Path) -> None:
    """Preflight accepts the folder; the engine's greedy tokens and the model's float32 logits over
    paged, chunked prefill and batched decode equal transformers'."""
    check_builtin_family(json.loads((path / "config.json").read_text()))
    vocab = reference.config.vocab_size
    llm = LLM(path, backend="torch_ref", block_size=4, max_num_batched_tokens=8, device="cpu")
    for prompt, out in zip(prompts(vocab), llm.generate(prompts(vocab), GREEDY), strict=True):
        assert out.token_ids == greedy_reference(reference, prompt, GREEDY.max_tokens)[0]
    model = load_model(path, TORCH_REF, torch.float32, "cpu")
    assert_generates_like_transformers(model, reference, prompts(vocab), GREEDY.max_tokens, prefill_chunk=5)


Rewrite = Callable[[dict[str, object]], None]
V3_YARN = {**YARN, "mscale_all_dim": 1.0, "mscale": 1.0}
PARITY: dict[str, tuple[PretrainedConfig, type[PreTrainedModel], Rewrite | None]] = {
    # head_dim wins over hidden_size // num_attention_heads (32 // 4 = 8)
    "llama_head_dim": (LlamaConfig(**LLAMA, head_dim=16), LlamaForCausalLM, None),
    # GraniteConfig has no head_dim field, yet its attention reads one from config.json
    "granite_head_dim": (
        GraniteConfig(**LLAMA, **GRANITE_MULTIPLIERS, head_dim=12), GraniteForCausalLM, None),
    # num_key_value_heads null: as many KV heads as query heads
    "llama_kv_heads_null": (LlamaConfig(**{**LLAMA, "num_key_value_heads": None}), LlamaForCausalLM, None),
    # legacy rope_theta at the top level with no rope_scaling: the default RoPE at that base
    "llama_legacy_theta": (
        LlamaConfig(**LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 300.0}),
        LlamaForCausalLM, legacy_rope),
    # legacy rope_scaling {"type": "linear"} + rope_theta, read as rope_parameters
    "llama_legacy_linear": (
        LlamaConfig(**LLAMA, rope_parameters={"rope_type": "linear", "factor": 3.0, "rope_theta": 700.0}),
        LlamaForCausalLM, legacy_rope),
    "llama_llama3": (LlamaConfig(**LLAMA, rope_parameters=LLAMA3), LlamaForCausalLM, None),
    "llama_yarn_legacy": (LlamaConfig(**LLAMA, rope_parameters=YARN), LlamaForCausalLM, legacy_rope),
    # Granite SWA without layer_types: transformers' default (layer i full when i % 4 == 0)
    "granite_swa_default_layers": (
        GraniteSWAConfig(**{**LLAMA, "num_hidden_layers": 5}, **GRANITE_MULTIPLIERS, sliding_window=3),
        GraniteSWAForCausalLM, None),
    # V3: norm_topk_prob off (the class default is on), groups, YaRN; a real-world topk_method and
    # scoring_func that agree with the architecture
    "v3_unnormalized_yarn": (
        DeepseekV3Config(**DEEPSEEK, q_lora_rank=48, n_group=4, topk_group=2, norm_topk_prob=False,
                         routed_scaling_factor=2.5, rope_parameters=V3_YARN),
        DeepseekV3ForCausalLM, lambda data: data.update(topk_method="noaux_tc", scoring_func="sigmoid")),
}


@pytest.mark.parametrize("name", list(PARITY))
def test_disagreeing_fields_follow_transformers(name: str, tmp_path: Path) -> None:
    config, model_cls, change = PARITY[name]
    config.architectures = [model_cls.__name__]
    constants = DEEPSEEK_CONSTANTS if "Deepseek" in model_cls.__name__ else GRANITE_CONSTANTS
    reference = write_model(model_cls, config, tmp_path, constants, SEED)
    if change is not None:
        rewrite_config(tmp_path, change)
    assert_engine_and_model_match(reference, tmp_path)


def config_dict(config: PretrainedConfig, architecture: str, **changes: object) -> dict[str, object]:
    """config.json's contents for `config` as `architecture`, with `changes` on top."""
    config.architectures = [architecture]
    return {**config.to_dict(), **changes}


def llama(**changes: object) -> dict[str, object]:
    return config_dict(LlamaConfig(**LLAMA), "LlamaForCausalLM", **changes)


def deepseek_v2(**changes: object) -> dict[str, object]:
    config = DeepseekV2Config(**DEEPSEEK, q_lora_rank=None)
    return config_dict(config, "DeepseekV2ForCausalLM", **changes)


def deepseek_v3(**changes: object) -> dict[str, object]:
    config = DeepseekV3Config(**DEEPSEEK, n_group=2, topk_group=1)
    return config_dict(config, "DeepseekV3ForCausalLM", **changes)


SWA_LAYERS = ["sliding_attention", "full_attention", "full_attention", "full_attention"]
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
LONGROPE = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
            "original_max_position_embeddings": 16}
PARTIAL = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
REFUSED: dict[str, tuple[Callable[[], dict[str, object]], str]] = {
    "llama_window": (lambda: llama(sliding_window=3), "sliding_window 3"),
    "llama_layer_types": (lambda: llama(layer_types=SWA_LAYERS, sliding_window=3), "layer_types"),
    "granite_window": (
        lambda: config_dict(GraniteConfig(**LLAMA), "GraniteForCausalLM", sliding_window=5),
        "sliding_window 5"),
    "llama_embedding_multiplier": (lambda: llama(embedding_multiplier=2.0), "embedding_multiplier 2.0"),
    "llama_attention_multiplier": (lambda: llama(attention_multiplier=0.3), "attention_multiplier 0.3"),
    "llama_layer_rope_theta": (lambda: llama(layer_rope_theta=[1e4, 0, 500.0, 1e4]), "layer_rope_theta"),
    "llama_sinks": (lambda: llama(use_sinks=True), "use_sinks=True"),
    "granitemoe_shared": (
        lambda: config_dict(GraniteMoeConfig(**LLAMA, **GRANITE_MOE), "GraniteMoeForCausalLM",
                            shared_intermediate_size=24),
        "shared_intermediate_size 24"),
    "dynamic_rope": (lambda: llama(rope_parameters=DYNAMIC), "rope_parameters.rope_type 'dynamic'"),
    "longrope": (lambda: llama(rope_parameters=LONGROPE), "rope_parameters.rope_type 'longrope'"),
    "partial_rotary": (lambda: llama(rope_parameters=PARTIAL), "partial_rotary_factor 0.5"),
    "model_type_mismatch": (lambda: llama(architectures=["GraniteForCausalLM"]),
                            "model_type 'llama' makes transformers build LlamaForCausalLM"),
    "v2_noaux_tc": (
        lambda: deepseek_v2(topk_method="noaux_tc", n_group=2, topk_group=1), "topk_method 'noaux_tc'"),
    "v2_norm_topk_prob": (lambda: deepseek_v2(norm_topk_prob=True), "norm_topk_prob=true"),
    "v2_sigmoid": (lambda: deepseek_v2(scoring_func="sigmoid"), "scoring_func 'sigmoid'"),
    "v2_rope_not_interleaved": (lambda: deepseek_v2(rope_interleave=False), "rope_interleave=false"),
    "v2_groups_missing": (
        lambda: deepseek_v2(topk_method="group_limited_greedy"), "needs n_group and topk_group"),
    "v2_moe_layer_freq": (lambda: deepseek_v2(moe_layer_freq=2), "moe_layer_freq 2"),
    "v3_greedy": (lambda: deepseek_v3(topk_method="greedy"), "topk_method 'greedy'"),
    "v3_softmax": (lambda: deepseek_v3(scoring_func="softmax"), "scoring_func 'softmax'"),
    "v3_topk_group": (lambda: deepseek_v3(topk_group=3), "topk_group 3 exceeds n_group 2"),
    "v3_experts_per_group": (lambda: deepseek_v3(n_group=3, topk_group=1), "not divisible by n_group 3"),
    "v32_rope_not_interleaved": (
        lambda: config_dict(DeepseekV32Config(**DEEPSEEK_V32, index_topk=4), "DeepseekV32ForCausalLM",
                            rope_interleave=False),
        "rope_interleave=false"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_fields_jackfield_does_not_implement_are_refused_by_name(name: str) -> None:
    make, field = REFUSED[name]
    with pytest.raises(ValueError, match="config.json") as refused:
        check_builtin_family(make())
    assert field in str(refused.value)


@pytest.mark.parametrize("data", [
    llama(sliding_window=64),  # a window as long as the context (64) never bites
    llama(sliding_window=None, layer_types=["full_attention"] * 4),
    llama(embedding_multiplier=1.0, attention_multiplier=8**-0.5, use_sinks=False),
    deepseek_v2(scoring_func="softmax", topk_method="greedy", norm_topk_prob=False, moe_layer_freq=1),
    deepseek_v3(scoring_func="sigmoid", topk_method="noaux_tc", rope_interleave=True),
], ids=["window_at_the_limit", "full_layer_types", "neutral_multipliers", "v2_published", "v3_published"])
def test_fields_that_agree_with_the_architecture_are_accepted(data: dict[str, object]) -> None:
    check_builtin_family(data)


def test_v32_layer_types_follow_mlp_layer_types_over_first_k_dense_replace() -> None:
    config = DeepseekV32Config(**{**DEEPSEEK_V32, "first_k_dense_replace": 2}, index_topk=4,
                               mlp_layer_types=["sparse", "dense"], architectures=["DeepseekV32ForCausalLM"])
    arch = deepseek_arch(config)
    assert [arch.is_moe_layer(i) for i in range(2)] == [True, False]


def test_doctor_and_run_both_name_a_refused_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = LlamaConfig(**LLAMA, architectures=["LlamaForCausalLM"])
    write_model(LlamaForCausalLM, config, tmp_path, GRANITE_CONSTANTS, SEED)
    stray = {"sliding_window": 3, "layer_rope_theta": [1.0, 2.0, 3.0, 5.0]}  # fields Llama never reads
    rewrite_config(tmp_path, lambda data: data.update(stray))
    assert main(["doctor", "--model", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    with pytest.raises(ConfigError) as refused:
        LLM(str(tmp_path), device="cpu")
    problems = refused.value.problems
    fields = ("config.json", "layer_rope_theta", "sliding_window 3")
    named = [p for p in problems if all(f in p for f in fields)]
    assert named, problems  # both fields, in one problem line
    for problem in problems:
        assert problem.replace("\n", "\n    ") in out
    assert "Traceback" not in out
    # the same folder loads once the field transformers ignores is gone (a read_hf_config check)
    rewrite_config(tmp_path, lambda data: [data.pop(field) for field in stray])
    assert read_hf_config(tmp_path).architectures == ["LlamaForCausalLM"]

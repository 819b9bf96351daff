"""Llama / Granite / Granite SWA / Granite MoE (SWA) against transformers' own models: the same
random weights through a saved checkpoint, prompts longer than the window, chunked prefill and
batched decode over scattered paged blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jackfield.models.granite import GraniteForCausalLM, granite_weight_mapper
from jackfield.models.hf_config import granite_arch, layer_attention, read_hf_config
from paged_harness import TORCH_REF, generate, hf_reference, randomize_, save_hf_model
from transformers import (
    GraniteConfig,
    GraniteMoeConfig,
    GraniteMoeSWAConfig,
    GraniteSWAConfig,
    LlamaConfig,
    PretrainedConfig,
)
from transformers import (
    GraniteForCausalLM as HFGranite,
)
from transformers import (
    GraniteMoeForCausalLM as HFGraniteMoe,
)
from transformers import (
    GraniteMoeSWAForCausalLM as HFGraniteMoeSWA,
)
from transformers import (
    GraniteSWAForCausalLM as HFGraniteSWA,
)
from transformers import (
    LlamaForCausalLM as HFLlama,
)

SMALL = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
GRANITE = dict(
    embedding_multiplier=1.7, residual_multiplier=0.6, attention_multiplier=0.3, logits_scaling=2.5
)
SWA = dict(
    sliding_window=3,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
    layer_rope_theta=[10000.0, 0, 500.0, 10000.0],
)  # one NoPE layer, two RoPE bases
MOE = dict(num_local_experts=4, num_experts_per_tok=2)

CASES = {
    "llama": (HFLlama, LlamaConfig(**SMALL)),
    "llama_tied": (HFLlama, LlamaConfig(**{**SMALL, "tie_word_embeddings": True})),
    "granite": (HFGranite, GraniteConfig(**SMALL, **GRANITE)),
    "granite_swa": (HFGraniteSWA, GraniteSWAConfig(**SMALL, **GRANITE, **SWA)),
    "granitemoe": (HFGraniteMoe, GraniteMoeConfig(**SMALL, **GRANITE, **MOE)),  # older weight names
    "granitemoe_swa": (
        HFGraniteMoeSWA,
        GraniteMoeSWAConfig(**SMALL, **GRANITE, **SWA, **MOE, shared_intermediate_size=24),
    ),
}
PROMPTS = [
    [5, 17, 3, 88, 42, 9, 61, 2, 33, 70, 14],
    [90, 1, 56, 23, 8, 47, 11],
]  # both longer than the window


def build(name: str, tmp_path: Path) -> tuple[torch.nn.Module, GraniteForCausalLM]:
    hf_cls, config = CASES[name]
    config = config.__class__(**config.to_dict())  # a fresh copy: transformers mutates configs
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf_model = hf_cls(config).eval()
    randomize_(
        hf_model,
        ("sinks", "input_layernorm.weight", "post_attention_layernorm.weight", "norm.weight"),
        seed=1,
    )
    path = save_hf_model(hf_model, tmp_path / name)
    ours = GraniteForCausalLM.from_pretrained(path, read_hf_config(path), TORCH_REF, torch.float32, "cpu")
    return hf_model, ours


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_tokens_match_transformers(name: str, tmp_path: Path) -> None:
    hf_model, ours = build(name, tmp_path)
    max_new = 5
    tokens, logits = generate(ours, PROMPTS, max_new, block_size=4, prefill_chunk=5)
    for prompt, got_tokens, got_logits in zip(PROMPTS, tokens, logits, strict=True):
        want_tokens, want_logits = hf_reference(hf_model, prompt, max_new)
        assert got_logits.shape == want_logits.shape
        torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
        assert got_tokens == want_tokens


def test_swa_layers_and_sinks_are_really_used(tmp_path: Path) -> None:
    """The same checkpoint with the window widened and the sinks dropped gives other logits:
    the parity above could not pass by ignoring either."""
    hf_model, ours = build("granite_swa", tmp_path)
    _, base = generate(ours, PROMPTS[:1], 1)
    for layer in ours.model.layers:
        layer.self_attn.sinks.fill_(-1e4)
    _, no_sinks = generate(ours, PROMPTS[:1], 1)
    assert (base[0] - no_sinks[0]).abs().max() > 1e-2
    wide = read_hf_config(tmp_path / "granite_swa")
    wide.sliding_window = 64
    ours_wide = GraniteForCausalLM.from_pretrained(
        tmp_path / "granite_swa", wide, TORCH_REF, torch.float32, "cpu"
    )
    _, wide_logits = generate(ours_wide, PROMPTS[:1], 1)
    assert (base[0] - wide_logits[0]).abs().max() > 1e-2


def test_layer_attention_defaults_leave_llama_and_granite_unchanged() -> None:
    for config in (LlamaConfig(**SMALL), GraniteConfig(**SMALL)):
        pattern = layer_attention(config.to_dict())
        assert pattern.windows == (None,) * 4 and not pattern.sinks and not pattern.sliding_window
    # GraniteSWA without layer_types: its own default, every fourth layer full, and sinks.
    swa = layer_attention({"model_type": "granite_swa", "num_hidden_layers": 5, "sliding_window": 8})
    assert swa.windows == (None, 8, 8, 8, None) and swa.sinks
    # Only a window (Mistral): every layer slides.
    assert layer_attention({"num_hidden_layers": 2, "sliding_window": 6}).windows == (6, 6)
    arch = granite_arch(GraniteSWAConfig(**SMALL, **SWA, architectures=["GraniteSWAForCausalLM"]))
    assert arch.windows == (3, None, 3, 3) and arch.rope_thetas == (10000.0, 0.0, 500.0, 10000.0)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"num_hidden_layers": 2, "layer_types": ["full_attention"]}, "1 entries for 2 layers"),
        ({"num_hidden_layers": 1, "layer_types": ["chunked_attention"]}, "not supported"),
        ({"num_hidden_layers": 1, "layer_types": ["sliding_attention"]}, "positive integer sliding_window"),
        (
            {"num_hidden_layers": 1, "layer_types": ["sliding_attention"], "sliding_window": 0},
            "positive integer",
        ),
    ],
)
def test_layer_attention_rejects_bad_patterns(cfg: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layer_attention(cfg)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (LlamaConfig(**SMALL, hidden_act="gelu"), "hidden_act 'gelu'"),
        (LlamaConfig(**SMALL, attention_bias=True), "attention_bias=True"),
        (LlamaConfig(**SMALL, mlp_bias=True), "mlp_bias=True"),
    ],
)
def test_unsupported_settings_fail_closed(config: PretrainedConfig, message: str) -> None:
    config.architectures = ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match=message):
        granite_arch(config)


def test_other_architectures_are_refused() -> None:
    config = LlamaConfig(**SMALL, architectures=["MistralForCausalLM"])
    with pytest.raises(ValueError, match="MistralForCausalLM is not one of"):
        granite_arch(config)


def test_weight_mapper_knows_older_and_newer_moe_names() -> None:
    arch = granite_arch(GraniteMoeSWAConfig(**SMALL, **MOE, architectures=["GraniteMoeSWAForCausalLM"]))
    mapper = granite_weight_mapper(arch)
    prefix = "model.layers.3.block_sparse_moe"
    for old, new in (
        ("input_linear.weight", "experts.gate_up_proj"),
        ("output_linear.weight", "experts.down_proj"),
        ("router.layer.weight", "router.weight"),
    ):
        assert mapper.target(f"{prefix}.{old}") == mapper.target(f"{prefix}.{new}")
    assert mapper.target(f"{prefix}.experts.gate_up_proj") == (f"{prefix}.experts.w13", None, None)
    assert mapper.target("model.layers.0.mlp.up_proj.weight") == (
        "model.layers.0.mlp.gate_up_proj.weight",
        None,
        (1, 2),
    )


def test_missing_sinks_in_checkpoint_are_reported(tmp_path: Path) -> None:
    """A Granite checkpoint loaded as Granite SWA: every missing sink is named."""
    hf_model, _ = build("granite", tmp_path)
    swa = GraniteSWAConfig(**SMALL, **GRANITE, **SWA, architectures=["GraniteSWAForCausalLM"])
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.sinks"):
        GraniteForCausalLM.from_pretrained(tmp_path / "granite", swa, TORCH_REF, torch.float32, "cpu")

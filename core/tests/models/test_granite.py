"""Llama / Granite / Granite SWA / Granite MoE (SWA) against transformers' own models: the same
random weights through a saved checkpoint, prompts longer than the window, chunked prefill and
batched decode over scattered paged blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jackfield.models.granite import GraniteForCausalLM, granite_weight_mapper
from jackfield.models.hf_config import granite_arch, layer_attention, read_hf_config
from jackfield.testing.checkpoints import (
    GRANITE_FAMILY,
    GRANITE_MOE,
    GRANITE_MULTIPLIERS,
    GRANITE_SWA_LAYERS,
    LLAMA,
    write_granite,
)
from jackfield.testing.paged import TORCH_REF, assert_generates_like_transformers, generate
from transformers import GraniteConfig, GraniteMoeSWAConfig, GraniteSWAConfig, LlamaConfig, PretrainedConfig

PROMPTS = [
    [5, 17, 3, 88, 42, 9, 61, 2, 33, 70, 14],
    [90, 1, 56, 23, 8, 47, 11],
]  # both longer than the window


def build(name: str, tmp_path: Path) -> tuple[torch.nn.Module, GraniteForCausalLM]:
    """transformers' model of GRANITE_FAMILY[name] and Jackfield's, from one saved checkpoint."""
    path = tmp_path / name
    hf_model = write_granite(name, path)
    ours = GraniteForCausalLM.from_pretrained(path, read_hf_config(path), TORCH_REF, torch.float32, "cpu")
    return hf_model, ours


@pytest.mark.parametrize("name", list(GRANITE_FAMILY))
def test_logits_and_greedy_tokens_match_transformers(name: str, tmp_path: Path) -> None:
    hf_model, ours = build(name, tmp_path)
    max_new = 5
    assert_generates_like_transformers(ours, hf_model, PROMPTS, max_new, prefill_chunk=5)


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
    for config in (LlamaConfig(**LLAMA), GraniteConfig(**LLAMA)):
        pattern = layer_attention(config.to_dict())
        assert pattern.windows == (None,) * 4 and not pattern.sinks and not pattern.sliding_window
    # GraniteSWA without layer_types: its own default, every fourth layer full, and sinks.
    swa = layer_attention({"model_type": "granite_swa", "num_hidden_layers": 5, "sliding_window": 8})
    assert swa.windows == (None, 8, 8, 8, None) and swa.sinks
    # Only a window (Mistral): every layer slides.
    assert layer_attention({"num_hidden_layers": 2, "sliding_window": 6}).windows == (6, 6)
    arch = granite_arch(
        GraniteSWAConfig(**LLAMA, **GRANITE_SWA_LAYERS, architectures=["GraniteSWAForCausalLM"])
    )
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
        (LlamaConfig(**LLAMA, hidden_act="gelu"), "hidden_act 'gelu'"),
        (LlamaConfig(**LLAMA, attention_bias=True), "attention_bias=True"),
        (LlamaConfig(**LLAMA, mlp_bias=True), "mlp_bias=True"),
    ],
)
def test_unsupported_settings_fail_closed(config: PretrainedConfig, message: str) -> None:
    config.architectures = ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match=message):
        granite_arch(config)


def test_other_architectures_are_refused() -> None:
    config = LlamaConfig(**LLAMA, architectures=["MistralForCausalLM"])
    with pytest.raises(ValueError, match="MistralForCausalLM is not one of"):
        granite_arch(config)


def test_weight_mapper_knows_older_and_newer_moe_names() -> None:
    arch = granite_arch(
        GraniteMoeSWAConfig(**LLAMA, **GRANITE_MOE, architectures=["GraniteMoeSWAForCausalLM"])
    )
    mapper = granite_weight_mapper(arch)

    def target(name: str) -> tuple[str, int | None, tuple[int, int] | None]:
        param, expert, rule = mapper.target(name)
        return param, expert, rule.shard

    prefix = "model.layers.3.block_sparse_moe"
    for old, new in (
        ("input_linear.weight", "experts.gate_up_proj"),
        ("output_linear.weight", "experts.down_proj"),
        ("router.layer.weight", "router.weight"),
    ):
        assert target(f"{prefix}.{old}") == target(f"{prefix}.{new}")
    assert target(f"{prefix}.experts.gate_up_proj") == (f"{prefix}.experts.w13", None, None)
    up = target("model.layers.0.mlp.up_proj.weight")
    assert up == ("model.layers.0.mlp.gate_up_proj.weight", None, (1, 2))
    # q, k and v fill qkv_proj's rows in proportion to their heads
    name, _, rule = mapper.target("model.layers.2.self_attn.k_proj.weight")
    assert name == "model.layers.2.self_attn.qkv_proj.weight"
    q_rows, kv_rows = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    assert rule.shard_rows(q_rows + 2 * kv_rows) == slice(q_rows, q_rows + kv_rows)


def test_missing_sinks_in_checkpoint_are_reported(tmp_path: Path) -> None:
    """A Granite checkpoint loaded as Granite SWA: every missing sink is named."""
    hf_model, _ = build("granite", tmp_path)
    swa = GraniteSWAConfig(
        **LLAMA, **GRANITE_MULTIPLIERS, **GRANITE_SWA_LAYERS, architectures=["GraniteSWAForCausalLM"]
    )
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.sinks"):
        GraniteForCausalLM.from_pretrained(tmp_path / "granite", swa, TORCH_REF, torch.float32, "cpu")


def test_a_16_bit_model_reads_its_sinks_written_since_the_last_step(tmp_path: Path) -> None:
    """The float32 copy of a bf16 model's sinks (kept to save a cast kernel a layer and step)
    follows every write of the parameter, in place (a CUDA graph reads it by address), and
    the attention really reads it: new sinks give other logits."""
    write_granite("granite_swa", tmp_path / "swa")
    ours = GraniteForCausalLM.from_pretrained(tmp_path / "swa", read_hf_config(tmp_path / "swa"), TORCH_REF,
                                              torch.bfloat16, "cpu")
    attention = ours.model.layers[0].self_attn
    copy = attention.float32_sinks()
    assert copy.dtype == torch.float32 and torch.equal(copy, attention.sinks.float())
    _, base = generate(ours, PROMPTS[:1], 1)
    for layer in ours.model.layers:
        layer.self_attn.sinks.fill_(-1e4)
    assert attention.float32_sinks() is copy and torch.equal(copy, attention.sinks.float())  # bf16: -9984
    _, no_sinks = generate(ours, PROMPTS[:1], 1)
    assert (base[0] - no_sinks[0]).abs().max() > 1e-2

"""Tiny random checkpoints of the built-in model families, written by transformers' own classes.

Each `write_*` builds a transformers model from its real config class with seeded random weights,
gives the parameters transformers starts at a constant (norm weights 1, sinks and router biases 0)
random values too, so that a model ignoring them fails a comparison, saves it, and returns it
(float32, eval, eager attention): the reference for the Jackfield model loaded from the directory.
`greedy_reference` and `pooled_reference` are that reference's answers.
"""

from __future__ import annotations

import inspect
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    GraniteMoeConfig,
    GraniteMoeForCausalLM,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    GraniteMoeSWAConfig,
    GraniteMoeSWAForCausalLM,
    GraniteSWAConfig,
    GraniteSWAForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from jackfield.models.embedding import pool

# ---- DeepSeek V2 / V3 (MLA, routed experts) and V3.2 (+ the lightning indexer) ----------------
DEEPSEEK = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
    qk_nope_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    first_k_dense_replace=1, max_position_embeddings=512, initializer_range=0.2,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128, mscale=1.0,
    mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
)  # fmt: skip
DEEPSEEK_VARIANTS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, object]]] = {
    "v3": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(q_lora_rank=48, n_group=2, topk_group=1)),
    "v3-no-qlora-yarn": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(
        q_lora_rank=None, n_group=4, topk_group=2, rope_interleave=False, rope_parameters=YARN)),
    "v2-grouped": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(
        q_lora_rank=48, topk_method="group_limited_greedy", n_group=2, topk_group=1,
        routed_scaling_factor=1.5)),
    "v2-no-qlora": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(q_lora_rank=None, topk_method="greedy")),
}  # fmt: skip
DEEPSEEK_V32 = dict(
    vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    n_group=2, topk_group=1, first_k_dense_replace=1, index_n_heads=8, index_head_dim=16,
    max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip
DEEPSEEK_CONSTANTS = (
    "e_score_correction_bias", "layernorm.weight", "model.norm.weight", "k_norm.weight", "k_norm.bias"
)

# ---- Llama / Granite / Granite SWA / Granite MoE (SWA) (grouped-query attention) --------------
LLAMA = dict(
    vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip
GRANITE_MULTIPLIERS = dict(
    embedding_multiplier=1.7, residual_multiplier=0.6, attention_multiplier=0.3, logits_scaling=2.5
)
GRANITE_SWA_LAYERS = dict(
    sliding_window=3,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
    layer_rope_theta=[10000.0, 0, 500.0, 10000.0],
)  # one NoPE layer, two RoPE bases
GRANITE_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
GRANITE_FAMILY: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, object]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "llama_tied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "granite": (GraniteConfig, GraniteForCausalLM, GRANITE_MULTIPLIERS),
    "granite_swa": (GraniteSWAConfig, GraniteSWAForCausalLM, {**GRANITE_MULTIPLIERS, **GRANITE_SWA_LAYERS}),
    "granitemoe": (GraniteMoeConfig, GraniteMoeForCausalLM, {**GRANITE_MULTIPLIERS, **GRANITE_MOE}),
    "granitemoe_swa": (GraniteMoeSWAConfig, GraniteMoeSWAForCausalLM, {
        **GRANITE_MULTIPLIERS, **GRANITE_SWA_LAYERS, **GRANITE_MOE, "shared_intermediate_size": 24}),
}  # fmt: skip  # granitemoe: the older weight names
GRANITE_CONSTANTS = ("sinks", "input_layernorm.weight", "post_attention_layernorm.weight", "norm.weight")

# ---- Hybrid models: Qwen3-Next (Gated DeltaNet + gated attention + MoE), Granite 4.0 hybrid (Mamba2)
QWEN3_NEXT = dict(
    vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
    linear_value_head_dim=6, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
    mlp_only_layers=[1], max_position_embeddings=128, initializer_range=0.1, tie_word_embeddings=False,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
)  # fmt: skip
GRANITE_HYBRID = dict(
    vocab_size=97, hidden_size=32, intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, shared_intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    mamba_n_heads=4, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2,
    position_embedding_type="rope", max_position_embeddings=128, initializer_range=0.1,
    tie_word_embeddings=False, **GRANITE_MULTIPLIERS,
)  # fmt: skip
HYBRID_FAMILY: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, object]]] = {
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM, QWEN3_NEXT),
    "granitemoehybrid": (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, GRANITE_HYBRID),
    "granitemoehybrid_dense_nope": (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, {
        **GRANITE_HYBRID, "num_local_experts": 0, "position_embedding_type": None}),
}  # fmt: skip
HYBRID_CONSTANTS = ("layernorm.weight", "norm.weight", "dt_bias", "A_log", ".D", "conv1d.bias")


def randomize_constants(model: nn.Module, names: tuple[str, ...], seed: int) -> None:
    """Parameters named (or ending in) one of `names` get random values: norm weights around 1,
    the others around 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(name.endswith(n) for n in names):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5 + (1.0 if "norm" in name else 0.0))


def write_model(
    model_cls: type[PreTrainedModel],
    config: PretrainedConfig,
    directory: Path,
    constants: tuple[str, ...],
    seed: int = 0,
) -> PreTrainedModel:
    """Build `model_cls(config)` with weights drawn from `seed`, randomize `constants`, save it."""
    config._attn_implementation = "eager"
    with torch.random.fork_rng():  # the caller's random stream is left where it was
        torch.manual_seed(seed)
        model = model_cls(config).eval()
    randomize_constants(model, constants, seed + 1)
    model.save_pretrained(str(directory), safe_serialization=True)
    return model


def write_deepseek(variant: str, directory: Path, seed: int = 0, **config: object) -> PreTrainedModel:
    """A DEEPSEEK_VARIANTS model; `config` overrides DEEPSEEK's entries or adds (is_causal, pooling)."""
    config_cls, model_cls, extra = DEEPSEEK_VARIANTS[variant]
    return write_model(
        model_cls, config_cls(**{**DEEPSEEK, **extra, **config}), directory, DEEPSEEK_CONSTANTS, seed
    )


def write_deepseek_mtp(variant: str, directory: Path, num_mtp_layers: int = 1, seed: int = 0,
                       **config: object) -> tuple[PreTrainedModel, PreTrainedModel, dict[str, torch.Tensor]]:
    """A DEEPSEEK_VARIANTS checkpoint with `num_mtp_layers` multi-token-prediction layers in
    DeepSeek's published layout (transformers' model skips them), in a file of their own.

    MTP layer i is `model.layers.{L + i}`: a decoder layer's tensors (those of layer L + i of a
    transformers model of L + n layers, so its index picks MLP or MoE as transformers does),
    enorm, hnorm, eh_proj [H, 2H] and shared_head.norm (random), and copies of the target's
    embedding and head as embed_tokens and shared_head.head. Returns (the target, that
    transformers model of L + n layers (the reference of the MTP decoder layers), the tensors of
    the MTP file)."""
    target = write_deepseek(variant, directory, seed, num_nextn_predict_layers=num_mtp_layers, **config)
    num_layers = target.config.num_hidden_layers
    config_cls, model_cls, extra = DEEPSEEK_VARIANTS[variant]
    longer = config_cls(**{**DEEPSEEK, **extra, **config, "num_hidden_layers": num_layers + num_mtp_layers})
    with tempfile.TemporaryDirectory() as scratch:  # saved for transformers' checkpoint names
        extended = write_model(model_cls, longer, Path(scratch), DEEPSEEK_CONSTANTS, seed + 2)
        saved = load_file(str(Path(scratch) / "model.safetensors"))
        tensors = {name: tensor for name, tensor in saved.items()
                   if any(name.startswith(f"model.layers.{num_layers + i}.") for i in range(num_mtp_layers))}
    gen = torch.Generator().manual_seed(seed + 3)
    size = target.config.hidden_size
    for i in range(num_mtp_layers):
        prefix = f"model.layers.{num_layers + i}."
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[prefix + norm + ".weight"] = torch.randn(size, generator=gen) * 0.5 + 1.0
        tensors[prefix + "eh_proj.weight"] = torch.randn(size, 2 * size, generator=gen) * (2 * size) ** -0.5
        tensors[prefix + "embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
        tensors[prefix + "shared_head.head.weight"] = target.lm_head.weight.detach().clone()
    save_file(tensors, str(directory / "mtp.safetensors"))
    return target, extended, tensors


def write_deepseek_v32(directory: Path, index_topk: int, seed: int = 0, **config: object) -> PreTrainedModel:
    """A DeepSeek-V3.2 model; `config` overrides DEEPSEEK_V32's entries."""
    config = DeepseekV32Config(**{**DEEPSEEK_V32, **config}, index_topk=index_topk)
    return write_model(DeepseekV32ForCausalLM, config, directory, DEEPSEEK_CONSTANTS, seed)


def write_granite(name: str, directory: Path, seed: int = 0, **config: object) -> PreTrainedModel:
    """A GRANITE_FAMILY model; `config` overrides LLAMA's entries."""
    config_cls, model_cls, extra = GRANITE_FAMILY[name]
    return write_model(
        model_cls, config_cls(**{**LLAMA, **extra, **config}), directory, GRANITE_CONSTANTS, seed
    )


def write_hybrid(name: str, directory: Path, seed: int = 0, **config: object) -> PreTrainedModel:
    """A HYBRID_FAMILY model; `config` overrides its entries."""
    config_cls, model_cls, base = HYBRID_FAMILY[name]
    return write_model(model_cls, config_cls(**{**base, **config}), directory, HYBRID_CONSTANTS, seed)


def granite_hybrid_reference_problem(model: PreTrainedModel) -> str | None:
    """Why transformers' GraniteMoeHybrid `model` computes another Mamba2 than Granite 4.0's, or None.

    Mamba2 normalizes its gated output per group of B and C (mamba_ssm's RMSNormGated with
    group_size = inner / n_groups; Jackfield does the same); transformers before 5.23 normalizes
    the whole inner size at once: the same for one group (the published checkpoints), not for
    more. Told by behaviour: normalized per group, scaling the last group leaves the first
    group's output as it was."""
    groups = getattr(model.config, "mamba_n_groups", 1)
    mixers = [layer.mamba for layer in model.model.layers if getattr(layer, "mamba", None) is not None]
    if groups == 1 or not mixers:
        return None
    norm = mixers[0].norm
    width = norm.weight.shape[0] // groups
    gen = torch.Generator().manual_seed(0)
    x, gate = torch.randn(2, 1, groups * width, generator=gen)
    scaled = x.clone()
    scaled[:, -width:] *= 10.0
    with torch.no_grad():
        first, first_scaled = norm(x, gate)[:, :width], norm(scaled, gate)[:, :width]
    if torch.allclose(first, first_scaled, rtol=1e-5, atol=1e-6):
        return None
    return (f"transformers {transformers.__version__} normalizes Mamba2's gated output over all "
            f"{groups} groups at once, not per group (fixed in transformers 5.23)")


@contextmanager
def torch_paths(model: PreTrainedModel) -> Iterator[None]:
    """transformers' own PyTorch functions in `model`'s modeling module while the block runs.

    Where flash-linear-attention, mamba_ssm or causal_conv1d import, transformers binds their
    kernels in place of its PyTorch functions (the gated delta rule, Mamba2's scan, the causal
    conv1d) when the modeling module is imported: Triton kernels for CUDA tensors only, while
    these references run on the CPU. Each such binding is a wrapper from transformers'
    hub_kernels module that keeps the PyTorch function as `__wrapped__`."""
    module = sys.modules[type(model).__module__]
    hub_kernels = sys.modules.get("transformers.integrations.hub_kernels")
    swapped = {
        name: value for name, value in vars(module).items()
        if hub_kernels is not None and inspect.isfunction(value) and hasattr(value, "__wrapped__")
        and value.__code__.co_filename == hub_kernels.__file__
    }  # fmt: skip
    try:
        for name, value in swapped.items():
            setattr(module, name, inspect.unwrap(value))
        yield
    finally:
        for name, value in swapped.items():
            setattr(module, name, value)


def greedy_reference(
    model: PreTrainedModel, prompt: list[int], max_new: int
) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens (a full forward per token, no cache, no generation-config logit
    processors, its PyTorch paths) and its logits over prompt + generated[:-1]."""
    tokens: list[int] = []
    with torch.no_grad(), torch_paths(model):
        for _ in range(max_new):
            ids = torch.tensor([prompt + tokens])
            logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
            tokens.append(int(logits[-1].argmax()))
    return tokens, logits  # the last forward ran over prompt + tokens[:-1]


def pooled_reference(model: PreTrainedModel, pooling: str, prompts: list[list[int]]) -> torch.Tensor:
    """[len(prompts), hidden] pooled final hidden states, every key visible (a full 4D mask)."""
    rows = []
    with torch.no_grad(), torch_paths(model):
        for prompt in prompts:
            ids = torch.tensor([prompt])
            full = torch.zeros(1, 1, len(prompt), len(prompt))  # additive mask: nothing masked
            hidden = model.model(ids, attention_mask=full).last_hidden_state[0]
            rows.append(pool(hidden, [0, len(prompt)], pooling)[0])
    return torch.stack(rows)
